"""`--set PATH=VALUE` on the recipe (plan/overlay.py): typed and validated like the file, errors naming the path."""

from __future__ import annotations

import json

import pytest

from reproduce.errors import UserError
from reproduce.plan.overlay import changes_of, overlay, parse_override
from reproduce.plan.recipe import load_recipe

GPT = "papers/pysource-gpt.yaml"


def apply_overrides(recipe, overrides):
    """`--set` as the CLI applies it: each PATH=VALUE a change of its field, the recipe validated again."""
    return overlay(recipe, changes_of(overrides), "the recipe")


def test_a_value_is_read_as_yaml_at_its_dotted_path():
    assert parse_override("optimizer.lr=1e-4") == (["optimizer", "lr"], "1e-4")  # YAML 1.1: pydantic reads it
    assert parse_override("data.max_length = 1024") == (["data", "max_length"], 1024)
    assert parse_override("model.lora.target_modules=[q_proj, v_proj]")[1] == ["q_proj", "v_proj"]
    assert parse_override("model.weights=")[1] is None


def test_overrides_change_the_fields_and_nothing_else():
    recipe = load_recipe(GPT)
    changed = apply_overrides(recipe, ["optimizer.lr=1e-4", "schedule.total.steps=7"])
    assert changed.optimizer.lr == 1e-4 and isinstance(changed.optimizer.lr, float)
    assert changed.schedule.total.steps == 7
    assert changed.model_copy(update={"optimizer": recipe.optimizer, "schedule": recipe.schedule}) == recipe
    assert apply_overrides(recipe, []) is recipe


def test_the_later_override_of_a_field_wins():
    recipe = apply_overrides(load_recipe(GPT), ["optimizer.lr=0.1", "optimizer.lr=0.2"])
    assert recipe.optimizer.lr == 0.2


def test_a_missing_section_is_made_and_validated():
    recipe = apply_overrides(load_recipe(GPT), ["schedule.warmup.steps=5"])
    assert recipe.schedule.warmup is not None and recipe.schedule.warmup.steps == 5


@pytest.mark.parametrize("override, expected", [
    ("optimizer.lr=-1", "`overrides`: optimizer.lr: must be > 0.0 (got -1)"),
    ("optimizer.lrr=0.1", "`overrides`: optimizer.lrr: unknown key (did you mean 'lr'?)"),
    ("batch.effective=many", "`overrides`: batch.effective: expected an integer (got 'many')"),
    ("optimizer.lr", "`overrides` optimizer.lr: expected FIELD.PATH=VALUE, e.g. `overrides` optimizer.lr=1e-4"),
    ("optimizer..lr=1", "`overrides` optimizer..lr=1: expected FIELD.PATH=VALUE, e.g. `overrides` optimizer.lr=1e-4"),
    ("optimizer.lr=[1", "`overrides` optimizer.lr=[1: the value is not YAML: "),
    ("optimizer.lr.x=1", "`overrides` optimizer.lr.x=1: optimizer.lr: is "),
])
def test_a_bad_override_is_one_line_naming_the_field(override, expected):
    with pytest.raises(UserError) as caught:
        apply_overrides(load_recipe(GPT), [override])
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith(expected), caught.value.lines[0]


def test_an_override_obeys_the_rules_across_sections():
    """The whole recipe is validated again: a rule between two sections holds for an override as for the file."""
    with pytest.raises(UserError) as caught:
        apply_overrides(load_recipe(GPT), ["batch.unit=tokens", "batch.sequence_length=null"])
    assert caught.value.lines[0].startswith("`overrides`: batch")
    assert "sequence_length" in caught.value.lines[0]


def test_a_list_item_by_its_number():
    recipe = load_recipe("papers/pysource-gpt-phases.yaml")
    first = recipe.batch.phases[0]
    changed = apply_overrides(recipe, [f"batch.phases.0.steps={first.steps + 1}"])
    assert changed.batch.phases[0].steps == first.steps + 1
    with pytest.raises(UserError, match=r"batch.phases.9: expected an item number below 2"):
        apply_overrides(recipe, ["batch.phases.9.steps=1"])


# ---- the commands ---------------------------------------------------------------------------------------------

def test_plan_takes_set_validated_as_the_file(capsys):
    from core_helpers import cli

    code, out, err = cli(capsys, "plan", GPT, "--micro-batch-max", "16", "--set", "optimizer.lr=0.0005", "--json")
    assert code == 0, err
    assert json.loads(out)["lr"] == 0.0005
    code, out, err = cli(capsys, "plan", GPT, "--micro-batch-max", "16", "--set", "batch.effective=2048", "--set",
                         "batch.per_device=32", "--json")  # 2048 tokens of 64: 32 sequences, on the paper's 1 device
    assert code == 0, err
    planned = json.loads(out)
    assert (planned["effective_batch"], planned["arithmetic"]) == (32, "16 x 2 x 1 = 32 sequences (2048 tokens)")
    code, out, err = cli(capsys, "plan", GPT, "--micro-batch-max", "16", "--set", "batch.effective=2048")
    assert (code, err) == (2, "error: --set: batch: devices x per_device = 1 x 64 = 64, but effective is 32 "
                              "sequences; state the paper's accumulation steps or correct the numbers\n")
    code, out, err = cli(capsys, "plan", GPT, "--micro-batch-max", "16", "--set", "optimizer.lr=-1")
    assert (code, err) == (2, "error: --set: optimizer.lr: must be > 0.0 (got -1)\n")
