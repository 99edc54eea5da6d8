"""A `reproduce-plan/1` file (flat fields, written before the plan was made of its parts) still loads: the files in
tests/data were written by `reproduce plan --out` and `reproduce run` at a1e9f2b, and each loads as the plan the
planner makes today, whose flat view (`plan --json`'s fields) is the file itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from reproduce.errors import UserError
from reproduce.plan.flatview import FLAT_FIELDS, FLAT_FORMAT, flat_fields
from reproduce.plan.planfile import PLAN_FORMAT, load_plan, parse_plan, plan_to_yaml
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
V1_FILES = {  # file: (recipe, micro_batch_max) of the command that wrote it
    "plan-v1-phases.yaml": ("papers/pysource-gpt-phases.yaml", 16),  # batch phases: two segments
    "plan-v1-batchnorm.yaml": ("papers/goyal2017-resnet50.yaml", 16),  # BatchNorm plan and warning
    "plan-v1-digits.yaml": ("papers/digits-mlp.yaml", 16),  # a run folder's plan.yaml: one whole segment
}


@pytest.mark.parametrize("name", sorted(V1_FILES))
def test_a_v1_plan_file_loads_as_todays_plan_and_its_flat_view_is_the_file(name):
    v1 = yaml.safe_load((DATA / name).read_text(encoding="utf-8"))
    assert v1["format"] == FLAT_FORMAT
    loaded = load_plan(DATA / name)
    assert loaded.format == PLAN_FORMAT
    assert flat_fields(loaded) == {key: value for key, value in v1.items() if key != "recipe"}
    assert list(flat_fields(loaded)) == list(FLAT_FIELDS) == [key for key in v1 if key != "recipe"]
    recipe_path, micro_batch_max = V1_FILES[name]
    # (the v1 files predate the recipes' gates: the plan made today without them)
    recipe = load_recipe(ROOT / recipe_path).model_copy(update={"gates": []})
    made = make_plan(recipe, micro_batch_max, recipe_path=recipe_path)
    data_facts = {"data_fingerprint": loaded.data_fingerprint}  # what the run adds to the plan it made
    assert loaded == made.model_copy(update=data_facts)
    assert parse_plan(yaml.safe_load(plan_to_yaml(loaded)), "again.yaml") == loaded  # written again as v2


def test_the_converted_parts_keep_the_phases_and_batchnorm():
    phases = load_plan(DATA / "plan-v1-phases.yaml")
    assert [(s.kind, s.start_step, s.sequence_length) for s in phases.segments] == [("phase", 0, 32),
                                                                                     ("phase", 200, 64)]
    assert phases.schedule.end_step == 300 and phases.schedule.warmup_steps == 20
    resnet = load_plan(DATA / "plan-v1-batchnorm.yaml")
    assert resnet.batchnorm is not None and resnet.batchnorm.layers == 53
    assert resnet.batchnorm_warning is not None and resnet.batchnorm_warning.startswith("BatchNorm statistics")
    assert [s.kind for s in resnet.segments] == ["whole"]


def test_a_hand_edited_v1_file_is_still_checked(tmp_path):
    v1 = yaml.safe_load((DATA / "plan-v1-digits.yaml").read_text(encoding="utf-8"))
    v1["accumulation_steps"] += 1
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(v1, sort_keys=False), encoding="utf-8")
    with pytest.raises(UserError) as info:
        load_plan(path)
    assert info.value.lines[0] == (f"{path}: split.effective_batch: micro_batch x accumulation_steps x world_size "
                                   "= 16 x 17 x 1 = 272, not 256")
