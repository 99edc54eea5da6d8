"""The estimate against what the papers ran, on their own devices (the whole table is
`python bench/papers_probe.py --paper-batches`). One paper here; the LLaMA-7B ones are slow (a trial of the full-size
step takes 5 to 25 s on a loaded 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from reproduce.cli import main
from reproduce.hardware.catalog import lookup
from reproduce.plan.recipe import load_recipe
from reproduce.probe.meters import EstimateMeter
from reproduce.probe.workload import Workload

PAPERS = Path(__file__).resolve().parents[3] / "papers"


pytestmark = pytest.mark.usefixtures("probe_cache", "one_thread")


def paper_trial(name: str, world_size: int = 1):
    recipe = load_recipe(PAPERS / f"{name}.yaml")
    gpu = lookup(recipe.batch.device)
    sharding = recipe.batch.sharding if world_size > 1 else "none"
    meter = EstimateMeter(Workload(recipe), gpu.budget_bytes, 0.0, gpu=gpu, cap=recipe.batch.sequences // world_size,
                          sharding=sharding, world_size=world_size)
    return meter.measure(recipe.batch.per_device)


def test_nanogpt_twelve_sequences_fit_its_a100_40gb():
    """nanoGPT ran 12 x 1024 tokens per A100-40GB; counted with CPU kernels the estimate allowed 11."""
    trial = paper_trial("nanogpt-gpt2-124m")
    assert trial.fits and trial.parts["attention"] == {"flash": 48}  # 12 blocks x 2 micro-batches x 2 steps


@pytest.mark.slow
def test_alpaca_four_per_device_fit_with_fsdp_over_four_a100_80gb():
    trial = paper_trial("taori2023-alpaca-7b", world_size=4)
    assert trial.fits and trial.parts["sharded"]["world_size"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("gpu, way_out", [("a100-80gb", "[fits] --sharding fsdp --world-size "),
                                          ("rtx4090", "[fits] model.lora: ")])
def test_llama_7b_full_fine_tuning_on_one_gpu_says_what_it_needs_and_what_fits(capsys, gpu, way_out):
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["plan", str(PAPERS / "taori2023-alpaca-7b.yaml"), "--gpu", gpu])
    err = capsys.readouterr().err
    assert exit_.value.code == 3 and "Traceback" not in err
    lines = [line for line in err.splitlines() if not line.startswith("[transformers]")]
    assert lines[0].startswith(f"does not fit: not even micro-batch 1 fits --gpu {gpu}")
    assert any(line.startswith("  weights ") and "6.74B parameters in fp32" in line for line in lines)
    for part in ("gradients", "optimizer state", "activations of 1 sample"):
        assert any(line.startswith(f"  {part} ") for line in lines), part
    assert any(line.startswith("  " + way_out) for line in lines), err


@pytest.mark.slow
def test_alpaca_lora_plans_its_own_four_by_thirty_two_on_an_int8_base_on_one_rtx_4090():
    """Alpaca-LoRA's int8 LLaMA-7B (model.quantize: int8, fp16 autocast, as its repository trains): 4 a micro-batch
    fit one RTX 4090 (the 6.5 GB of int8 linear weights, the fp32 embeddings and head), so the plan is 4 x 32."""
    pytest.importorskip("bitsandbytes")
    recipe = load_recipe(PAPERS / "tloen2023-alpaca-lora.yaml")
    assert recipe.model.quantize == "int8"
    assert [d for d in recipe.deviations if "loss.normalization" not in d] == []  # the Trainer's loss arithmetic alone
    trial = paper_trial("tloen2023-alpaca-lora")
    assert trial.fits
    assert 6.4e9 < trial.parts["step"]["weights"] < 7.7e9  # 6.48B int8 weights + their scales + 0.26B fp32


@pytest.mark.slow
def test_qlora_guanaco_7b_four_per_device_fit_a_48_gb_card():
    """QLoRA's Guanaco 7B (nf4, double quantisation, r 64 on every linear layer, gradient checkpointing, paged
    AdamW): the script's 4 a micro-batch fit the 48 GB RTX A6000 with room to spare (docs/papers.md)."""
    pytest.importorskip("bitsandbytes")
    recipe = load_recipe(PAPERS / "dettmers2023-qlora-guanaco-7b.yaml")
    assert recipe.model.quantize == "nf4" and recipe.optimizer.paged and recipe.model.activation_checkpointing
    trial = paper_trial("dettmers2023-qlora-guanaco-7b")
    assert trial.fits and trial.peak_bytes < 16 * 2**30
    # nf4 linear layers (3.24e9 with their scales), the embeddings and head kept in bf16 (0.52e9) and the bf16
    # adapters (0.32e9): qlora.py's choices, which the recipe states (upcast_embeddings: false, lora.dtype: bf16)
    assert 3.9e9 < trial.parts["step"]["weights"] < 4.5e9
