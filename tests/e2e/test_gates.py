"""Gates in a run: a pause at a missed gate (its checkpoint, one line, exit status 4), accepting it, every gate's
checkpoint kept, `--resume --from GATE` bitwise the uninterrupted run, the budget's cost gate, the records."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import SGD, cli, digits_recipe
from reproduce.data import build_data
from reproduce.errors import GatePaused, UserError
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.trainer import RunRequest, read_metrics, train

pytestmark = pytest.mark.usefixtures("one_thread")

WARM = {"name": "warm", "at": {"step": 3}, "metric": "loss", "max": 2.4, "smooth": 2}
ACCURATE = {"name": "accurate", "at": {"step": 6}, "metric": "eval_accuracy", "min": 0.1}


def gated(lr: float = 0.05, steps: int = 10, gates=(WARM, ACCURATE), **extra):
    recipe = digits_recipe({**SGD, "lr": lr}, steps=steps, data={"shuffle": True}, gates=list(gates), **extra)
    recipe["model"] = {"builtin": "mlp", "kwargs": {"dropout": 0.3}}  # dropout: the RNG state must resume too
    parsed = parse_recipe(recipe)
    data = build_data(parsed)
    return make_plan(parsed, micro_batch_max=16, dataset_size=len(data.train)), data


def events(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "gate"]


def test_gates_pass_keep_their_checkpoints_and_resume_from_one_is_bitwise(tmp_path):
    plan, data = gated()
    summary = train(plan, RunRequest(tmp_path / "full", device="cpu"), data=data)
    full = tmp_path / "full"
    assert [(e["name"], e["step"], e["status"]) for e in events(full)] == [("warm", 3, "passed"),
                                                                          ("accurate", 6, "passed")]
    assert [(g["name"], g["status"], g["step"]) for g in summary["gates"]] == [("warm", "passed", 3),
                                                                              ("accurate", "passed", 6)]
    assert {"gate-warm.pt", "gate-accurate.pt", "last.pt"} <= {p.name for p in (full / "checkpoints").iterdir()}
    step6 = [r for r in read_metrics(full / "metrics.jsonl") if r.get("step") == 6 and "loss" in r][0]
    assert "eval_accuracy" in step6 and step6["gates"] == {"accurate": "passed"}  # evaluated for the gate
    # from the first gate's checkpoint, in another folder holding the finished run: bitwise the uninterrupted run
    copy = tmp_path / "copy"
    import shutil

    shutil.copytree(full, copy)
    train(plan, RunRequest(copy, device="cpu", resume=True, from_gate="warm"), data=data)
    for name, tensor in torch.load(full / "model.pt", weights_only=True).items():
        assert torch.equal(tensor, torch.load(copy / "model.pt", weights_only=True)[name]), name
    losses = [(r["step"], r["loss"]) for r in read_metrics(full / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"]) for r in read_metrics(copy / "metrics.jsonl") if "loss" in r] == losses
    assert [e["name"] for e in events(copy)] == ["warm", "accurate"]  # (warm's from before, accurate checked again)
    with pytest.raises(UserError, match="no gate named 'nope'.*its gates: warm, accurate"):
        train(plan, RunRequest(copy, device="cpu", resume=True, from_gate="nope"), data=data)


def test_a_wrong_learning_rate_pauses_at_the_first_gate(tmp_path):
    plan, data = gated(lr=40.0, gates=(WARM, {**ACCURATE, "min": 0.99}))
    out = tmp_path / "run"
    with pytest.raises(GatePaused) as paused:
        train(plan, RunRequest(out, device="cpu"), data=data)
    assert paused.value.exit_code == 4
    line = str(paused.value)
    assert "\n" not in line and line.startswith("gate warm at step 3: loss ") and "misses <= 2.4" in line
    assert f"checkpoint {out / 'checkpoints' / 'gate-warm.pt'}" in line
    assert "--resume)" in line and "--resume --accept-gate warm)" in line
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 3  # nothing spent past the gate
    assert torch.load(out / "checkpoints" / "gate-warm.pt", weights_only=True)["step"] == 3
    # resumed without a fix, the gate is checked again and pauses again, before any step
    with pytest.raises(GatePaused, match="gate warm at step 3"):
        train(plan, RunRequest(out, device="cpu", resume=True), data=data)
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == 3
    # accepted, the run goes on to the next gate
    with pytest.raises(GatePaused, match="gate accurate at step 6: eval_accuracy .* misses >= 0.99"):
        train(plan, RunRequest(out, device="cpu", resume=True, accept_gate=("warm",)), data=data)
    assert [(e["name"], e["status"]) for e in events(out)] == [("warm", "paused"), ("warm", "accepted"),
                                                               ("accurate", "paused")]
    with pytest.raises(UserError, match="no gate named 'cold'"):
        train(plan, RunRequest(out, device="cpu", resume=True, accept_gate=("cold",)), data=data)


def test_a_warn_gate_goes_on(tmp_path):
    plan, data = gated(lr=40.0, steps=4, gates=[{**WARM, "action": "warn"}])
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu"), data=data)
    assert summary["steps"] == 4 and summary["gates"][0]["status"] == "warned"


def test_the_budget_pauses_the_run_when_its_forecast_passes_it(tmp_path):
    plan, data = gated(steps=12, gates=[], budget={"gpu_hours": 1e-7})
    with pytest.raises(GatePaused, match=r"gate budget at step 10: forecast_gpu_hours .* misses <= 1e-07; source: "
                                         r"budget.gpu_hours"):
        train(plan, RunRequest(tmp_path / "run", device="cpu"), data=data)
    plan, data = gated(steps=12, gates=[], budget={"gpu_hours": 100})
    summary = train(plan, RunRequest(tmp_path / "fine", device="cpu"), data=data)
    cost = summary["gates"][0]
    assert (cost["name"], cost["status"], cost["checked_at"], cost["bound"]) == ("budget", "held", 12, "<= 100")
    assert 0 < cost["value"] < 100


def test_cli_pause_exit_status_4_and_accept(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(digits_recipe({**SGD, "lr": 40.0}, steps=5, gates=[WARM])))
    out = tmp_path / "run"
    code, printed, err = cli(capsys, "run", recipe, "--out", out, "--micro-batch-max", "16", "--device", "cpu")
    assert code == 4, err
    assert err.strip().splitlines()[-1].startswith("paused: gate warm at step 3: loss ")
    code, printed, err = cli(capsys, "run", out / "plan.yaml", "--out", out, "--micro-batch-max", "16", "--device",
                             "cpu", "--resume", "--accept-gate", "warm")
    assert code == 0, err
    assert "gate warm at step 3: loss" in printed and "misses <= 2.4: accepted" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gates"][0]["status"] == "accepted" and summary["steps"] == 5
    # report marks the gates: a table row per gate event, and the cost so far
    code, _, err = cli(capsys, "report", out, "--out", tmp_path / "report" / "report.html", "--no-plots")
    assert code == 0, err
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Gates and cost" in text and "GPU-hours spent over 5 optimizer steps" in text
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines() if "| warm |" in line]
    assert [(row[1], row[2], row[6]) for row in cells] == [("warm", "3", "paused"), ("warm", "3", "accepted")]
    code, _, err = cli(capsys, "run", recipe, "--out", tmp_path / "x", "--from", "warm", "--device", "cpu")
    assert code == 2 and "--from: starts a resumed run from a gate's checkpoint; give it with --resume" in err



@pytest.mark.distributed
@pytest.mark.subprocess
def test_a_pause_under_two_processes_is_one_line_and_exit_status_4(tmp_path):
    """Both ranks pause after the same step and leave the group together (a rank that left first made gloo abort the
    other, and torchrun printed its traceback); the launcher says rank 0's line once, with the ranks' status 4."""
    import os
    import subprocess
    import sys

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(digits_recipe({**SGD, "lr": 40.0}, steps=5, gates=[WARM])))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
               "--micro-batch-max", "16", "--nproc-per-node", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 4, result.stderr
    assert "Traceback" not in result.stderr and "SIGABRT" not in result.stderr, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("paused:")] == [
        line for line in result.stderr.splitlines() if "gate warm" in line]
    assert sum(line.startswith("paused: gate warm at step 3: loss ") for line in result.stderr.splitlines()) == 1
    assert (out / "checkpoints" / "gate-warm.pt").is_file()


def goyal(reference=None, **changes):
    """The Goyal et al. miniature (batch 256 = 8 x 32, lr 0.4 = 0.05 x 256/32 by the linear rule), 12 steps."""
    with open("papers/goyal-mini-digits-8x.yaml") as handle:
        recipe = yaml.safe_load(handle)
    recipe["schedule"]["total"] = {"steps": 12}
    for path, value in changes.items():
        section, key = path.split(".")
        recipe[section][key] = value
    return parse_recipe({**recipe, **({"reference": reference} if reference else {})})


def run_goyal(recipe, out, micro_batch, **options):
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=micro_batch, dataset_size=len(data.train))
    return train(plan, RunRequest(out, device="cpu", no_noise_scale=True, **options), data=data)


def test_another_micro_batch_stays_in_the_reference_band_and_the_lr_rule_off_leaves_it(tmp_path):
    references = []
    for seed in (0, 1, 2):  # the band: 3 x the seed spread of three reference runs at micro-batch 32
        references.append(str(tmp_path / f"seed{seed}"))
        run_goyal(goyal(), tmp_path / f"seed{seed}", 32, seed=seed)
    same = run_goyal(goyal(), tmp_path / "micro16", 16, reference=tuple(references))
    assert same["reference"]["within"] and same["reference"]["compared"] == 12, same["reference"]
    # the linear scaling rule off: the base lr 0.05 of batch 32 at batch 256 (Goyal et al. Table 2a's "no scaling")
    off = run_goyal(goyal(**{"optimizer.lr": 0.05}, **{"schedule.warmup": {"epochs": 2, "start_lr": 0.05}}),
                    tmp_path / "off", 32, reference=tuple(references))
    assert not off["reference"]["within"] and off["reference"]["outside"] > 0, off["reference"]
    found = [e for e in events(tmp_path / "off") if e["name"] == "reference"]
    assert len(found) == 1 and found[0]["status"] == "warned" and found[0]["step"] == off["reference"]["first_outside"]
    assert "within" in found[0]["bound"] and "of the reference's" in found[0]["bound"]


def test_a_reference_band_the_user_sets_and_a_pause_on_leaving_it(tmp_path):
    run_goyal(goyal(), tmp_path / "ref", 32)
    recipe = goyal(reference={"band": 1e-3, "action": "pause"})
    summary = run_goyal(recipe, tmp_path / "micro8", 8, reference=(str(tmp_path / "ref"),))
    assert summary["reference"]["within"] and summary["reference"]["worst"] < 0.01  # differences of rounding
    wrong = goyal(reference={"band": 1e-3, "action": "pause"}, **{"optimizer.lr": 4.0})
    with pytest.raises(GatePaused, match=r"gate reference at step \d+: loss .* misses within 0.001 of the "):
        run_goyal(wrong, tmp_path / "wrong", 32, reference=(str(tmp_path / "ref"),))
    assert (tmp_path / "wrong" / "checkpoints" / "gate-reference.pt").is_file()
    with pytest.raises(UserError, match="one reference run gives no seed spread"):
        run_goyal(goyal(), tmp_path / "none", 32, reference=(str(tmp_path / "ref"),))
