"""Plans of the shipped fine-tuning recipes carry what the run does: `plan --json`'s memory_options (the quantised
base, the paged / 8-bit optimizer) and `plan --emit hf`'s optim and BitsAndBytesConfig, which builds the same
config as the run's (models/quantize.py)."""

from __future__ import annotations

import json
import re

import pytest

from helpers import cli
from reproduce.plan.recipe import load_recipe

transformers = pytest.importorskip("transformers")
QLORA, ALPACA = "dettmers2023-qlora-guanaco-7b", "tloen2023-alpaca-lora"


def test_plan_json_names_the_quantised_base_and_the_paged_optimizer(capsys):
    code, out, err = cli(capsys, "plan", QLORA, "--micro-batch-max", "4", "--json")
    assert code == 0, err
    options = json.loads(out)["memory_options"]
    assert options[0].startswith("nf4 base (QLoRA's 4-bit NormalFloat with double quantisation")
    assert options[1] == ("bitsandbytes adamw of 32-bit state, paged (its state in CUDA unified memory, paged to the "
                          "CPU when the GPU runs short)")


@pytest.mark.parametrize(("name", "optim"), [(QLORA, "paged_adamw_32bit"), (ALPACA, "adamw_torch")])
def test_emit_hf_carries_the_optimizer_and_the_bitsandbytes_config_of_the_run(name, optim, capsys):
    import torch

    from reproduce.models.quantize import quantization_config
    from reproduce.shipped import shipped_recipes

    code, out, err = cli(capsys, "plan", name, "--micro-batch-max", "4", "--emit", "hf")
    assert code == 0, err
    assert f'optim="{optim}",' in out
    emitted = re.search(r"# quantization_config = (transformers\.BitsAndBytesConfig\(.*\))\n", out).group(1)
    config = eval(emitted, {"transformers": transformers, "torch": torch})  # noqa: S307 (our own output)
    assert config.to_dict() == quantization_config(load_recipe(shipped_recipes()[name])).to_dict()
    assert "peft.prepare_model_for_kbit_training(model" in out and "peft.LoraConfig(r=" in out


@pytest.mark.parametrize(("form", "framework"), [("accelerate", "Accelerate"), ("lightning", "Lightning"),
                                                 ("deepspeed", "DeepSpeed's config")])
def test_every_emitted_form_says_what_it_cannot_express_of_a_finetune(form, framework, capsys):
    """The quantised base and bitsandbytes' optimizer state are no setting of these frameworks: each form says so,
    with the code the run uses; a recipe without them gets no such note."""
    from reproduce.plan.recipe import load_recipe as load
    from reproduce.shipped import shipped_recipes

    code, out, err = cli(capsys, "plan", QLORA, "--micro-batch-max", "4", "--emit", form)
    assert code == 0, err
    text = " ".join(line.lstrip("#").strip() for line in out.splitlines())
    assert f"{framework} has no setting for the recipe's nf4 base (model.quantize)" in text
    optimizer = load(shipped_recipes()[QLORA]).optimizer.bitsandbytes_class
    assert optimizer == "PagedAdamW32bit"
    assert f"step with bitsandbytes.optim.{optimizer}(params, lr=...)" in text
    code, out, err = cli(capsys, "plan", "hu2021-lora-gpt2m-e2e", "--micro-batch-max", "4", "--emit", form)
    assert code == 0, err
    assert "has no setting for the recipe's" not in out
