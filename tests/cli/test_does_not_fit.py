"""Sharding in the probe and the honest "does not fit": on a small GPT with a budget too small for it.

The step of micro-batch 1 is split by category (the parts sum to what was counted), the ways out are
computed, and each way out offered is re-probed and really fits. Through the CLI: exit code 3 and the
report, no traceback; bad combinations of options are bad input (exit code 2).
"""

from __future__ import annotations

import json

import pytest

from reproduce.cli import main
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.runner import ProbeOptions, run_probe
from reproduce.probe.tracker import rounded

GPT = {
    "batch": {"effective": 4096, "unit": "tokens", "sequence_length": 64},
    "task": "language-modeling",
    "model": {"builtin": "gpt", "kwargs": {"layers": 2, "heads": 2, "dim": 128, "vocab_size": 256, "dropout": 0.1}},
    "data": {"name": "a corpus we do not have", "available": False},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 10}},
    "precision": "bf16",
}
# The estimate adds 40 MiB for cuBLAS workspaces without --gpu: this leaves 7.5 MiB of tensors; the step needs 9.
TOO_SMALL = ProbeOptions(memory="48MiB", meter="estimate", headroom=0.0)


pytestmark = pytest.mark.usefixtures("isolated")


def recipe(**batch):
    return parse_recipe({**GPT, "batch": {**GPT["batch"], **batch}}, source="test")


@pytest.fixture(scope="module")
def failed():
    return run_probe(recipe(), options=TOO_SMALL)


def test_the_breakdown_comes_from_the_failed_trial_and_adds_up(failed):
    assert failed.micro_batch_max is None
    report = failed.does_not_fit
    trial = next(t for t in failed.trials if t.micro_batch == 1)
    assert report["micro_batch"] == 1 and report["tensor_bytes"] == trial.tensor_bytes
    assert report["peak_bytes"] == trial.peak_bytes > report["limit_bytes"]
    assert sum(report["at_peak"].values()) == report["tensor_bytes"]  # the parts are the whole
    params = 2 * (2 * 128 * 2 + 128 * 384 + 384 + 128 * 128 + 128 + 128 * 512 + 512 + 512 * 128 + 128)
    params += 256 * 128 + 64 * 128 + 2 * 128  # embeddings (the head is tied to the token one), final norm
    step = report["step"]
    assert report["parameters"] == params
    assert step["weights"] == step["gradients"] == sum(rounded(4 * n) for n in _tensor_sizes())
    assert step["optimizer_state"] == 2 * step["weights"] + 512 * len(_tensor_sizes())  # AdamW: 2 moments, steps
    assert 0 < step["activations"] < step["weights"] and step["weight_copies"] > 0


def _tensor_sizes() -> list[int]:
    from reproduce.models.small import GPT as SmallGPT

    return [p.numel() for p in SmallGPT(vocab_size=256, block_size=64, layers=2, heads=2, dim=128).parameters()]


def test_the_sharding_offered_fits_when_probed_and_one_process_fewer_does_not(failed):
    way = failed.does_not_fit["ways_out"][0]
    assert way["fits"] and way["change"].startswith("--sharding fsdp --world-size ")
    ranks = int(way["change"].rsplit(" ", 1)[1])
    # (the batch of `ranks` sequences caps each process at 1: one trial says whether micro-batch 1 fits)
    sharded = run_probe(recipe(effective=64 * ranks, sharding="fsdp"), options=TOO_SMALL, world_size=ranks)
    assert sharded.sharding == "fsdp" and sharded.micro_batch_max == 1
    assert sharded.trials[0].parts["sharded"]["world_size"] == ranks
    if ranks > 2:
        fewer = run_probe(recipe(effective=64 * (ranks - 1), sharding="fsdp"), options=TOO_SMALL,
                          world_size=ranks - 1)
        assert fewer.micro_batch_max is None


def test_a_fine_tuning_recipe_is_offered_lora_and_bf16_weights_and_they_fit_when_probed():
    fine_tuning = {**GPT, "model": {**GPT["model"], "pretrained": "a small GPT"}}
    result = run_probe(parse_recipe(fine_tuning, source="test"), options=TOO_SMALL)
    ways = {way["change"].split(":")[0]: way for way in result.does_not_fit["ways_out"]}
    assert ways["model.lora"]["changes"]["model"]["lora"]["target_modules"] == ["mlp.0", "mlp.2", "proj", "qkv"]
    assert ways["model.dtype"]["changes"] == {"model": {"dtype": "bf16"}}  # the recipe computes in bf16 already
    for name in ("model.lora", "model.dtype"):
        assert ways[name]["fits"]
        changed = {**fine_tuning, "batch": {**GPT["batch"], "effective": 64 * 2},  # capped at 2: one or two trials
                   "model": {**fine_tuning["model"], **ways[name]["changes"]["model"]}}
        assert run_probe(parse_recipe(changed, source="test"), options=TOO_SMALL).micro_batch_max >= 1


def test_sharding_lets_a_larger_micro_batch_fit():
    options = ProbeOptions(memory="52MiB", meter="estimate", headroom=0.0)
    whole = run_probe(recipe(effective=64 * 32), options=options, world_size=4)  # 8 per process at most
    sharded = run_probe(recipe(effective=64 * 32, sharding="fsdp"), options=options, world_size=4)
    assert sharded.micro_batch_max > whole.micro_batch_max >= 1
    assert "fsdp over 4 ranks" in sharded.notes[-1]


def test_recipe_sharding_with_one_process_probes_the_whole_step():
    result = run_probe(recipe(effective=64 * 2, sharding="fsdp"), options=ProbeOptions(memory="1GiB"))
    assert result.sharding == "none" and result.micro_batch_max == 2
    assert any("nothing to shard over" in note for note in result.notes)


# ---- through the CLI ------------------------------------------------------------------------------------------


def cli(capsys, tmp_path, *argv: str, **batch) -> tuple[int, str, str]:
    import yaml

    path = tmp_path / "gpt.yaml"
    path.write_text(yaml.safe_dump({**GPT, "batch": {**GPT["batch"], **batch}}), encoding="utf-8")
    capsys.readouterr()
    try:
        main([argv[0], str(path), *argv[1:]])
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_does_not_fit_exit_code_3_with_the_report(capsys, tmp_path):
    code, out, err = cli(capsys, tmp_path, "plan", "--memory", "48MiB", "--headroom", "0")
    assert code == 3 and "Traceback" not in err and "error:" not in err
    lines = err.splitlines()
    assert lines[0].startswith("does not fit: not even micro-batch 1 fits the --memory budget (limit 48.00 MiB")
    assert any(line.startswith("  weights ") and "parameters in fp32" in line for line in lines)
    assert any(line.startswith("  activations of 1 sample") for line in lines)
    assert any(line.startswith("  [fits] --sharding fsdp --world-size ") for line in lines)
    assert any("model.lora: not offered: the recipe trains from scratch" in line for line in lines)


def test_cli_json_reports_the_breakdown_and_still_exits_3(capsys, tmp_path):
    code, out, err = cli(capsys, tmp_path, "probe", "--memory", "48MiB", "--headroom", "0", "--json")
    assert code == 3
    summary = json.loads(out)
    assert summary["micro_batch_max"] is None and summary["does_not_fit"]["ways_out"][0]["fits"]


@pytest.mark.parametrize(
    "args, batch, expected",
    [
        (("--sharding", "fsdp"), {}, "error: --sharding fsdp: shards the model over the --world-size processes, and "
                                     "--world-size is 1; give --world-size 2 or more"),
        (("--sharding", "fsdp", "--world-size", "4", "--meter", "cpu"), {},
         "error: --meter cpu: measures one whole process and cannot shard"),
        (("--world-size", "2", "--meter", "cpu"), {"sharding": "fsdp"},
         "error: --meter cpu: measures one whole process and cannot shard"),
        (("--sharding", "zero3", "--world-size", "4"), {}, "error: Invalid value for '--sharding'"),
    ],
)
def test_bad_sharding_options_are_bad_input(capsys, tmp_path, args, batch, expected):
    for command in ("probe", "plan"):
        code, out, err = cli(capsys, tmp_path, command, "--memory", "1GiB", *args, **batch)
        assert code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith(expected), err


def test_a_fine_tuning_recipe_is_offered_a_quantised_base_and_it_fits_when_probed():
    """LoRA on an int8 base (nf4 when int8 does not fit) is a way out for a recipe that fine-tunes; re-probed, it
    fits."""
    pytest.importorskip("bitsandbytes")
    fine_tuning = {**GPT, "model": {**GPT["model"], "pretrained": "a small GPT"}}
    result = run_probe(parse_recipe(fine_tuning, source="test"), options=TOO_SMALL)
    ways = {way["change"].split(" ")[1]: way for way in result.does_not_fit["ways_out"]
            if way["change"].startswith("model.quantize")}
    assert list(ways) == ["int8"] and ways["int8"]["fits"]  # nf4 is not tried when int8 fits
    changes = ways["int8"]["changes"]["model"]
    assert changes["quantize"] == "int8" and changes["lora"]["target_modules"] == ["mlp.0", "mlp.2", "proj", "qkv"]
    changed = {**fine_tuning, "batch": {**GPT["batch"], "effective": 64 * 2},
               "model": {**fine_tuning["model"], **changes}}
    assert run_probe(parse_recipe(changed, source="test"), options=TOO_SMALL).micro_batch_max >= 1


def test_an_int8_recipe_that_does_not_fit_is_offered_nf4():
    pytest.importorskip("bitsandbytes")
    lora = {"r": 8, "alpha": 16, "target_modules": ["mlp.0", "mlp.2", "proj", "qkv"]}
    changed = {**GPT, "model": {**GPT["model"], "pretrained": "a small GPT", "quantize": "int8", "lora": lora}}
    tight = ProbeOptions(memory="42MiB", meter="estimate", headroom=0.0)
    refused = run_probe(parse_recipe(changed, source="test"), options=tight)
    assert refused.does_not_fit is not None
    offered = [way["change"] for way in refused.does_not_fit["ways_out"] if way["change"].startswith("model.quantize")]
    assert offered and all(change.startswith("model.quantize: nf4 (") for change in offered)
