"""`reproduce memory RECIPE --micro-batch N`: the step's memory by part, the phase of its peak, allocated against
reserved and driver-level, through the real CLI on tiny models."""

from __future__ import annotations

import pytest

from helpers import cli, cli_json

LM = """\
batch: {effective: 64, unit: samples, sequence_length: 32}
task: language-modeling
model: {builtin: gpt, kwargs: {layers: 2, heads: 2, dim: 64, vocab_size: 512, dropout: 0.0}}
data: {name: a corpus we do not have, available: false, train_size: 1000}
optimizer: {name: adamw, lr: 1.0e-3}
schedule: {total: {steps: 100}}
"""
DIGITS = """\
batch: {effective: 256, unit: samples}
task: classification
model: {builtin: mlp, kwargs: {hidden: 32}}
data: {builtin: digits}
optimizer: {name: sgd, lr: 0.1}
schedule: {total: {steps: 100}}
"""


@pytest.fixture(autouse=True)
def files(isolated, tmp_path):
    (tmp_path / "lm.yaml").write_text(LM, encoding="utf-8")
    (tmp_path / "digits.yaml").write_text(DIGITS, encoding="utf-8")


def test_the_cpu_meters_answer_is_the_real_steps_tensors_and_its_parts_sum_to_the_peak(capsys):
    """On the cpu meter the answer is what real CPU tensors held; the fake step that splits it counts the same bytes
    (CPU rules), and the parts at the peak sum to it."""
    answer = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "8", "--meter", "cpu")
    assert answer["meter"] == "cpu" and answer["accumulates"] and answer["reserved_bytes"] is None
    assert answer["tensor_bytes"] == answer["allocated_bytes"]
    fake = sum(answer["at_peak"].values())
    assert 0.999 * answer["allocated_bytes"] <= fake <= 1.001 * answer["allocated_bytes"]
    held = answer["held"]
    weights = 4 * (512 * 64 + 32 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64)  # tied head; the GPT's blocks
    assert abs(held["weights"] - weights) < 0.02 * weights
    assert held["gradients"] == pytest.approx(held["weights"], rel=0.02)
    assert held["optimizer state"] == pytest.approx(2 * held["weights"], rel=0.02)  # AdamW's two moments
    logits = 8 * 32 * 512 * 4  # the fp32 logits of one micro-batch
    assert logits <= held["logits and loss"] < held["activations"]
    assert answer["peak_stage"] == "backward"


def test_the_peak_moves_to_the_optimizer_step_when_activations_are_small(capsys):
    """One sequence of 2 tokens: activations are tiny, and AdamW's foreach step (temporaries the size of every
    parameter) holds the peak; fused AdamW has no such temporaries, and the peak goes back to forward/backward."""
    answer = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "1", "--sequence-length", "2", "--gpu",
                      "a100-40gb")
    assert answer["peak_stage"] == "optimizer step"
    assert answer["at_peak"]["optimizer step"] > 0
    fused = LM.replace("name: adamw,", "name: adamw, implementation: fused,")
    with open("fused.yaml", "w", encoding="utf-8") as file:
        file.write(fused)
    answer = cli_json(capsys, "memory", "fused.yaml", "--micro-batch", "1", "--sequence-length", "2", "--gpu",
                      "a100-40gb")
    assert answer["peak_stage"] != "optimizer step" and "fused" in answer["optimizer"]


def test_estimate_reserved_and_driver_figures_state_their_allowances(capsys):
    answer = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "4", "--gpu", "a100-40gb")
    allowances = answer["allowances"]
    assert answer["reserved_bytes"] == answer["allocated_bytes"] + allowances[
        "allocator segments and fragmentation (5%)"] + allowances["cuBLAS and cuBLASLt workspaces"]
    assert answer["driver_bytes"] == answer["reserved_bytes"] + allowances["CUDA context and kernels (allowance)"]
    assert answer["fits"] is True and answer["budget_bytes"] > answer["limit_bytes"]
    unbounded = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "4", "--meter", "estimate")
    assert unbounded["fits"] is None and unbounded["budget_bytes"] is None


def test_the_sequence_length_scales_the_activations(capsys):
    short = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "4", "--meter", "estimate",
                     "--sequence-length", "32")
    long = cli_json(capsys, "memory", "lm.yaml", "--micro-batch", "4", "--meter", "estimate",
                    "--sequence-length", "64")
    assert long["sequence_length"] == 64
    assert 1.8 < long["held"]["activations"] / short["held"]["activations"] < 2.2
    assert long["held"]["weights"] - short["held"]["weights"] == 32 * 64 * 4  # the GPT's positions: one per token


def test_paged_optimizer_state_is_shown_outside_pytorchs_allocator(capsys):
    """bitsandbytes' paged AdamW keeps the state of tensors of 1e5 elements or more in CUDA unified memory: not in
    allocated nor reserved, but in the driver's figure."""
    pytest.importorskip("bitsandbytes")
    paged = LM.replace("dim: 64", "dim: 320").replace("name: adamw,", "name: adamw, paged: true,")
    with open("paged.yaml", "w", encoding="utf-8") as file:
        file.write(paged)
    answer = cli_json(capsys, "memory", "paged.yaml", "--micro-batch", "2", "--meter", "estimate")
    outside = answer["held"]["optimizer state outside PyTorch's allocator"]
    assert outside >= 2 * 4 * 12 * 320 * 320 * 0.99  # the blocks' matrices, 2 moments in fp32
    assert answer["allocated_bytes"] == answer["tensor_bytes"] - outside
    assert answer["driver_bytes"] - answer["reserved_bytes"] == 512 * 2**20 + outside
    assert "PagedAdamW" in answer["optimizer"]


def test_the_text_answer_and_bad_input(capsys):
    code, out, err = cli(capsys, "memory", "digits.yaml", "--micro-batch", "16", "--gpu", "t4")
    assert code == 0, err
    for expected in ("what the step holds", "weights", "gradients", "peak: in ", "allocated (max_memory_allocated)",
                     "reserved (max_memory_reserved)", "driver (nvidia-smi", "CUDA context", "fits: limit"):
        assert expected in out
    code, out, err = cli(capsys, "memory", "digits.yaml", "--micro-batch", "16", "--sequence-length", "8",
                         "--meter", "estimate")
    assert code == 2 and err.strip().splitlines() == [
        "error: --sequence-length: the recipe's samples are not token sequences (it sets the tokens of a language "
        "model's sequence)"]
