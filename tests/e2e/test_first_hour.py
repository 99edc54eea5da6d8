"""A newcomer's first hour: ordinary mistakes get one `error:` line (exit 2, nothing written, no
traceback), messages point at the real fix, the printed resume command continues the same run, and the run says
what its result means."""

from __future__ import annotations

import json
import pickle
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from helpers import cli, snapshot
from reproduce.observe.noise import MIN_VERDICT_STEPS, summarise
from reproduce.observe.outputs import read_metrics
from reproduce.observe.reference import DivergenceWatch
from reproduce.plan.recipe import parse_recipe
from reproduce.plan.reported import compare_reported, reported_line

ROOT = Path(__file__).resolve().parents[2]

# the 65-character model of the nanoGPT Shakespeare recipe, made small enough for a test
CHAR_RECIPE = {
    "batch": {"effective": 2048, "unit": "tokens", "sequence_length": 32},
    "task": "language-modeling",
    "model": {"builtin": "gpt-char", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 32}},
    "data": {"name": "shakespeare_char", "available": False, "format": "tokens"},
    "optimizer": {"name": "adamw", "lr": 1.0e-3},
    "schedule": {"total": {"steps": 5000}},
}
DIGITS = {
    "batch": {"effective": 64},
    "task": "classification",
    "model": {"builtin": "mlp"},
    "data": {"builtin": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"warmup": {"steps": 5}, "total": {"steps": 300}},
}


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe))
    return path


def refused(capsys, tmp_path: Path, *args: str) -> str:
    """Run a command that must refuse its input: exit 2, one `error:` line, no traceback, the user's --out folder
    (holding a file of theirs) unchanged. Returns the line."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "notes.txt").write_text("the user's own file\n")
    before = snapshot(out)
    if args[0] == "run" and "--force" not in args:  # past the --out check: the user's file stays all the same
        args = (*args, "--force")
    code, _, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    assert snapshot(out) == before
    return lines[0]


def char_tokens(folder: Path, ids_below: int, count: int = 20_000, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    generator = np.random.default_rng(seed)
    generator.integers(0, ids_below, count).astype(np.uint16).tofile(folder / "train.bin")
    generator.integers(0, ids_below, count // 4).astype(np.uint16).tofile(folder / "val.bin")
    return folder


# ---- 1. token ids outside the model's vocabulary ---------------------------------------------------------------

def test_gpt2_tokens_given_to_the_character_model_are_refused_before_training(tmp_path, capsys):
    data = char_tokens(tmp_path / "gpt2", 50257)
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16", "--force")
    assert line.startswith(f"error: data.path: {data / 'train.bin'}: token ids up to 5025")
    assert "the model's vocabulary has 65 ids (0-64)" in line
    # the maximum was read once and cached beside the file, keyed by its size and time
    cache = json.loads((data / ".train.bin.max-id.json").read_text())
    assert cache["max_id"] == int(np.fromfile(data / "train.bin", dtype=np.uint16).max())


def test_a_text_file_given_as_tokens_is_refused_naming_meta_pkl(tmp_path, capsys):
    data = tmp_path / "text"
    data.mkdir()
    (data / "train.bin").write_text("First Citizen: Before we proceed any further, hear me speak. " * 40)
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 65, "itos": {0: "\n"}, "stoi": {"\n": 0}}))
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16")
    assert f"data.path: {data / 'train.bin'}: token ids up to " in line
    assert "vocabulary has 65 ids" in line and "meta.pkl beside it says vocab_size 65" in line


def test_evaluation_tokens_are_checked_too(tmp_path, capsys):
    data = char_tokens(tmp_path / "char", 65)
    np.arange(0, 300, dtype=np.uint16).tofile(data / "val.bin")
    recipe = write(tmp_path / "char.yaml", CHAR_RECIPE)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "16")
    assert line.startswith(f"error: data.eval_path: {data / 'val.bin'}: token ids up to 299")


# ---- 2. a schedule of zero optimizer steps ---------------------------------------------------------------------

@pytest.mark.parametrize("total, reads", [
    ({"tokens": 5000}, "64 sequences (16,384 tokens)"),
    ({"samples": 20}, "64 sequences (16,384 tokens)"),
], ids=["tokens", "samples"])
def test_zero_optimizer_steps_are_refused_by_plan_and_run(total, reads, tmp_path, capsys):
    recipe = dict(CHAR_RECIPE, batch={"effective": 16384, "unit": "tokens", "sequence_length": 256},
                  schedule={"total": total})
    path = write(tmp_path / "short.yaml", recipe)
    line = refused(capsys, tmp_path, "plan", path, "--micro-batch-max", "64")
    expected = f"is less than one optimizer step, which reads {reads}: the run would take 0 optimizer steps"
    assert line.startswith("error: schedule.total: ") and expected in line
    data = char_tokens(tmp_path / "char", 65, count=40_000)
    line = refused(capsys, tmp_path, "run", path, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                   "--micro-batch-max", "64", "--force")
    assert expected in line


def test_a_fraction_of_an_epoch_under_one_step_is_refused(tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", dict(DIGITS, data={"builtin": "digits", "train_size": 1437},
                                                schedule={"total": {"epochs": 0.01}}))
    line = refused(capsys, tmp_path, "plan", path, "--micro-batch-max", "16")
    assert line == ("error: schedule.total: 0.01 epochs is less than one optimizer step, which reads 64 samples; an "
                    "epoch is 22 optimizer steps: the run would take 0 optimizer steps; give a longer total")


def test_a_plan_file_edited_to_zero_steps_is_refused(tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", DIGITS)
    assert cli(capsys, "plan", path, "--micro-batch-max", "16", "--out", tmp_path / "plan.yaml")[0] == 0
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    plan["schedule"]["end_step"] = 0
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    line = refused(capsys, tmp_path, "run", tmp_path / "plan.yaml", "--out", tmp_path / "out", "--device", "cpu")
    assert "schedule.end_step: must be >= 1 (got 0): one optimizer step reads 64 samples" in line


# ---- 3. data marked available: false -----------------------------------------------------------------------------

def test_unavailable_data_says_to_pass_data_and_its_format(tmp_path, capsys):
    line = refused(capsys, tmp_path, "run", ROOT / "papers" / "nanogpt-shakespeare-char.yaml", "--out",
                   tmp_path / "out", "--micro-batch-max", "4", "--device", "cpu")
    assert line == ("error: data: 'shakespeare_char' is marked available: false: give its path with --data PATH "
                    "(format tokens: a binary file of uint16 token ids, or a nanoGPT data folder holding train.bin "
                    "(and val.bin))")


def test_unavailable_data_without_a_format_says_what_would_make_it_runnable(tmp_path, capsys):
    recipe = dict(DIGITS, data={"name": "imagenet-1k", "available": False, "train_size": 1281167})
    line = refused(capsys, tmp_path, "run", write(tmp_path / "r.yaml", recipe), "--out", tmp_path / "out",
                   "--micro-batch-max", "4", "--device", "cpu")
    assert "marked available: false and names no data.format: this recipe can be planned but not run here" in line
    assert "data.factory" in line and "--data PATH" in line


# ---- 5. --memory without a unit ----------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["plan", "run"])
def test_memory_without_a_unit_is_refused(command, tmp_path, capsys):
    path = write(tmp_path / "digits.yaml", DIGITS)
    extra = ["--out", tmp_path / "out", "--device", "cpu"] if command == "run" else []
    line = refused(capsys, tmp_path, command, path, "--memory", "8", "--meter", "cpu", *extra)
    assert line == "error: --memory: 8 bytes? give a unit, e.g. 8GiB"


def test_memory_sizes_with_units_and_large_byte_counts_still_parse():
    from reproduce.plan.units import parse_size

    assert parse_size("8GiB") == 8 * 2**30 and parse_size("2097152") == 2**21 and parse_size("1MiB") == 2**20


# ---- 6-8. the resume hint, --max-steps, and the whole run's summary -----------------------------------------------

def start_and_sigterm_at(command: list[str], metrics: Path, step: int, cwd: Path, code: int | None = 143) -> str:
    """Start a run, send SIGTERM once it has logged `step` optimizer steps; its stderr (`code`: its exit code, None:
    any but 0)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.monotonic() + 180
    while not metrics.exists() or len(metrics.read_text().splitlines()) < step:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code if code is not None else process.returncode != 0, stderr
    return stderr


def test_the_resume_hint_after_sigterm_pasted_as_printed_stops_at_max_steps(tmp_path):
    """The acceptance case: SIGTERM at step 5 of `--max-steps 30` (of a 300-step plan); the printed command, pasted,
    goes on to step 30 and no further, and done: / summary.json count the whole run."""
    recipe, out = write(tmp_path / "digits.yaml", DIGITS), tmp_path / "out"
    command = [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
               "--micro-batch-max", "16", "--max-steps", "30", "--workers", "0"]
    metrics = out / "metrics.jsonl"
    stderr = start_and_sigterm_at(command, metrics, 5, tmp_path)
    stopped = len(metrics.read_text().splitlines())
    assert 5 <= stopped < 30, stderr
    hint = stderr.split("Continue with: ", 1)[1].strip()
    assert hint == (f"reproduce run {out / 'plan.yaml'} --out {out} --resume --max-steps 30 --micro-batch-max 16 "
                    "--workers 0 --device cpu")
    args = shlex.split(hint)
    assert args[0] == "reproduce"
    resumed = subprocess.run([sys.executable, "-m", "reproduce", *args[1:]], capture_output=True, text=True,
                             cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    records = [r for r in read_metrics(metrics) if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 31))  # stopped at 30 of the plan's 300
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["planned_steps"] == 300 and summary["resumed_from_step"] == stopped
    assert summary["samples"] == sum(r["samples"] for r in records) == 30 * 64
    assert summary["this_call"]["steps"] == 30 - stopped
    assert summary["this_call"]["samples"] == (30 - stopped) * 64
    assert summary["seconds"] > summary["this_call"]["seconds"] > 0
    done = next(line for line in resumed.stdout.splitlines() if line.startswith("done: "))
    assert done.startswith(f"done: 30 steps in {summary['seconds']:.1f}s ({30 - stopped} in this call, "
                           f"{summary['this_call']['seconds']:.1f}s)")


@pytest.mark.slow  # two torchrun launches of two processes: ~45 s on 2 busy cores
def test_the_resume_hint_under_torchrun_relaunches_the_same_processes(tmp_path):
    recipe, out = write(tmp_path / "digits.yaml", DIGITS), tmp_path / "out"
    command = [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
               "--micro-batch-max", "8", "--max-steps", "30", "--nproc-per-node", "2", "--checkpoint-every", "1"]
    # (torchrun itself, sent the signal, stops with an exit code and a traceback of its own: not this test's matter)
    stderr = start_and_sigterm_at(command, out / "metrics.jsonl", 5, tmp_path, code=None)
    hint = stderr.split("Continue with: ", 1)[1].splitlines()[0].strip()
    assert hint.startswith(f"reproduce run {out / 'plan.yaml'} --out {out} --resume --nproc-per-node 2 --max-steps 30 "
                           "--micro-batch-max 8 --device cpu")
    resumed = subprocess.run([sys.executable, "-m", "reproduce", *shlex.split(hint)[1:]], capture_output=True,
                             text=True, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r] == list(range(1, 31))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["world_size"] == 2 and summary["samples"] == 30 * 64


def test_max_steps_counts_from_the_start_and_a_resume_past_it_says_what_goes_on(tmp_path, capsys):
    recipe, out = write(tmp_path / "digits.yaml", DIGITS), tmp_path / "out"
    assert cli(capsys, "run", recipe, "--out", out, "--device", "cpu", "--micro-batch-max", "16",
               "--max-steps", "10")[0] == 0
    before = snapshot(out)
    code, _, err = cli(capsys, "run", out / "plan.yaml", "--out", out, "--resume", "--max-steps", "10")
    assert code == 2 and err.count("\n") == 1 and snapshot(out) == before
    assert err.strip() == (f"error: --max-steps: {out} has already run 10 of 10 optimizer steps; --max-steps counts "
                           "from the start of the run (of 300 steps): to run 10 more, give --max-steps 20")
    code, printed, _ = cli(capsys, "run", out / "plan.yaml", "--out", out, "--resume", "--max-steps", "20")
    assert code == 0 and "done: 20 steps in " in printed and "(10 in this call, " in printed
    import inspect

    from reproduce.cli.run import run_command

    assert "counted from the start of the run" in inspect.signature(run_command).parameters["max_steps"].default.help


def test_the_hint_keeps_torchruns_options(tmp_path, monkeypatch):
    from reproduce.cli.run import continue_command, launcher_args, launcher_of_this_job, request_args
    from reproduce.plan.overlay import Change
    from reproduce.storage.lock import LAUNCHER_ENV
    from reproduce.train.options import RunRequest

    launcher = launcher_args(2, 2, 0, "node0:29500")
    monkeypatch.setenv(LAUNCHER_ENV, shlex.join(launcher))
    assert launcher_of_this_job(4) == launcher  # what `reproduce run --nproc-per-node` passed its processes
    monkeypatch.delenv(LAUNCHER_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun started by hand: what it tells each process
    assert launcher_of_this_job(2) == ["--nproc-per-node", "2"]
    request = RunRequest(source=tmp_path / "recipe.yaml", out=tmp_path / "out", max_steps=30, stop_on_divergence=True,
                         changes=(Change("data.path", "/data/my set", "--data"),))
    assert continue_command(request, SimpleNamespace(distributed=False, size=1)).endswith(
        "--resume " + shlex.join(request_args(request, "resume")))  # one process: no launcher options
    monkeypatch.setenv(LAUNCHER_ENV, shlex.join(launcher))
    hint = continue_command(request, SimpleNamespace(distributed=True, size=4))
    assert shlex.split(hint) == ["reproduce", "run", str(tmp_path / "out" / "plan.yaml"), "--out",
                                 str(tmp_path / "out"), "--resume", "--nproc-per-node", "2", "--nnodes", "2",
                                 "--node-rank", "0", "--rdzv-endpoint", "node0:29500", "--max-steps", "30",
                                 "--stop-on-divergence", "--data", "/data/my set"]


# ---- 9. the result beside the paper's --------------------------------------------------------------------------

def test_the_run_puts_its_eval_loss_beside_the_papers(tmp_path, capsys):
    data = char_tokens(tmp_path / "char", 65)
    recipe = dict(CHAR_RECIPE, reported=[{"metric": "val_loss", "value": 1.4697, "split": "val"},
                                         {"metric": "bleu", "value": 70.4, "split": "test", "evaluated": False}])
    path = write(tmp_path / "char.yaml", recipe)
    code, printed, err = cli(capsys, "run", path, "--out", tmp_path / "out", "--data", data, "--device", "cpu",
                             "--micro-batch-max", "16", "--max-steps", "2")
    assert code == 0, err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    eval_loss = summary["final"]["eval_loss"]
    assert [row["metric"] for row in summary["reported"]] == ["val_loss"]  # BLEU on test: not what the run measured
    assert f"eval loss {eval_loss:.4g}; the paper reports val_loss 1.4697 on val at step 5000; this run stopped at " \
           "step 2 of 5000" in printed


def test_reported_metrics_are_matched_by_metric_split_and_scale():
    recipe = parse_recipe(dict(DIGITS, reported=[
        {"metric": "top1_error", "value": 23.74, "split": "val", "tolerance": 0.09},
        {"metric": "top1_accuracy", "value": 0.9},
        {"metric": "top1_accuracy", "value": 81.8, "split": "test"},
        {"metric": "glue_average", "value": 79.6, "split": "val", "evaluated": False},
    ]))
    rows = compare_reported(recipe, {"eval_accuracy": 0.75, "loss": 1.0}, 300, 300)
    # one scale: the run's fraction, and the paper's percentage (above 1) and its tolerance as fractions too
    assert [(r["metric"], round(r["run"], 6), r["paper"], r["tolerance"]) for r in rows] == [
        ("top1_error", 0.25, 0.2374, 0.0009), ("top1_accuracy", 0.75, 0.9, None)]
    assert reported_line(rows[0]) == ("eval top-1 error 0.25; the paper reports top1_error 0.2374 +- 0.0009 "
                                      "(23.74 +- 0.09%) on val at step 300; this run ran all 300 steps: outside the "
                                      "paper's tolerance")
    assert reported_line(rows[1]).startswith("eval top-1 accuracy 0.75; the paper reports top1_accuracy 0.9 at")
    within = compare_reported(recipe, {"eval_accuracy": 0.7630, "loss": 1.0}, 300, 300)[0]  # error 23.70
    assert reported_line(within).endswith("this run ran all 300 steps: within the paper's tolerance")
    early = compare_reported(recipe, {"eval_accuracy": 0.7630, "loss": 1.0}, 30, 300)[0]  # no verdict mid-run
    assert reported_line(early).endswith("this run stopped at step 30 of 300")
    assert compare_reported(recipe, {"loss": 1.0}, 3, 300) == []  # no evaluation: nothing to put beside it


# ---- 10. the noise scale's verdict, withheld when it would mislead --------------------------------------------

def noise_records(steps: int, first: int = 1) -> list[dict]:
    return [{"step": s, "loss": 1.0, "items": 256, "noise_grad_sq": 0.01, "noise_trace": 2.0, "noise_b_small": 32.0,
             "noise_scale": 200.0} for s in range(first, steps + 1)]


def test_noise_verdict_uses_the_last_tenth_or_the_final_value_and_says_which():
    summary = summarise(noise_records(200), 200, "classification")
    assert summary["verdict_from"] == "last_tenth" and "over the last tenth of the run" in summary["sentence"]
    summary = summarise(noise_records(30), 30, "classification")  # a tenth of 3 steps: the EMA over all 30
    assert summary["verdict_from"] == "final" and "(at the end)" in summary["sentence"]
    assert summary["last_tenth"] is not None  # still reported, not used


@pytest.mark.parametrize("records, total, options, reason", [
    (noise_records(30), 30, {"warmup_steps": 100}, "the run ended at step 30, inside its warm-up of 100 optimizer"),
    (noise_records(MIN_VERDICT_STEPS - 1), MIN_VERDICT_STEPS - 1, {},
     f"the measurement covers {MIN_VERDICT_STEPS - 1} optimizer steps (1 in the last tenth of the run), fewer than "
     f"the {MIN_VERDICT_STEPS} a verdict needs"),
    (noise_records(40), 40, {"diverged": {"step": 12, "reason": "..."}}, "the loss diverged (step 12)"),
], ids=["in-warm-up", "too-few-steps", "diverged"])
def test_noise_verdict_is_withheld_with_the_reason(records, total, options, reason):
    summary = summarise(records, total, "classification", **options)
    assert summary["verdict_from"] is None and summary["withheld"].startswith(reason)
    assert summary["sentence"] == f"verdict withheld: {summary['withheld']}"
    assert summary["final"] == 200.0  # the figures stay in summary.json


def test_a_run_that_stops_inside_its_warm_up_withholds_the_verdict(tmp_path, capsys):
    recipe = write(tmp_path / "digits.yaml", dict(DIGITS, schedule={"warmup": {"steps": 50}, "total": {"steps": 300}}))
    code, printed, _ = cli(capsys, "run", recipe, "--out", tmp_path / "out", "--device", "cpu", "--micro-batch-max",
                           "16", "--max-steps", "12")
    assert code == 0
    noise = json.loads((tmp_path / "out" / "summary.json").read_text())["noise_scale"]
    assert noise["verdict_from"] is None and noise["measured_steps"] == 12
    assert "noise scale: verdict withheld: the run ended at step 12, inside its warm-up of 50 optimizer steps" in \
        " ".join(printed.split())


# ---- 11. divergence -------------------------------------------------------------------------------------------

def test_divergence_watch_counts_steps_in_a_row_and_warns_once():
    watch = DivergenceWatch(factor=2.0, steps=3)
    losses = [2.0, 5.0, 5.0, 3.0, 4.5, 4.5, 4.5, 9.0]  # a two-step spike, then three in a row above 4.0
    said = [watch.update(step, loss) for step, loss in enumerate(losses, start=1)]
    assert said[:6] == [None] * 6 and said[7] is None
    assert said[6] == ("the run is diverging: the loss has stayed above 2x its first value (2) for 3 optimizer "
                       "steps, up to 4.5 at step 7")
    again = DivergenceWatch()
    again.load_state_dict(watch.state_dict())
    assert again.diverged == {"step": 7, "reason": said[6].removeprefix("the run is diverging: ")}
    assert DivergenceWatch().update(1, float("nan")) == "the run is diverging: the loss is not finite (nan) at " \
        "optimizer step 1"


def test_a_diverging_run_warns_once_and_goes_on_or_stops_when_asked(tmp_path, capsys):
    recipe = write(tmp_path / "div.yaml", dict(DIGITS, optimizer={"name": "sgd", "lr": 8.0, "momentum": 0.9},
                                               schedule={"total": {"steps": 30}}))
    args = ["run", recipe, "--device", "cpu", "--micro-batch-max", "16", "--skip-nonfinite"]
    code, _, err = cli(capsys, *args, "--out", tmp_path / "on")
    assert code == 0
    warnings = [line for line in err.splitlines() if "diverging" in line]
    summary = json.loads((tmp_path / "on" / "summary.json").read_text())
    step = summary["divergence"]["step"]
    assert len(warnings) == 1 and warnings[0].startswith("warning: the run is diverging: ")
    assert f"at step {step} (the run goes on; --stop-on-divergence stops it)" in warnings[0]
    assert summary["steps"] == 30 and summary["noise_scale"]["withheld"].startswith("the loss diverged")
    code, _, err = cli(capsys, *args, "--out", tmp_path / "off", "--stop-on-divergence")
    assert code == 1 and "Traceback" not in err
    assert "stopped: the run is diverging: " in err and "stopped (--stop-on-divergence)" in err
    assert len(read_metrics(tmp_path / "off" / "metrics.jsonl")) == step


# ---- 4. a plan made from a data factory knows the data's size ----------------------------------------------------

OWN = ROOT / "examples" / "own-model"


def test_plan_asks_the_data_factory_for_its_size(tmp_path, capsys):
    code, printed, err = cli(capsys, "plan", OWN / "recipe.yaml", "--micro-batch-max", "32", "--out",
                             tmp_path / "plan.yaml")
    assert code == 0, err
    text = " ".join(printed.split())
    assert "4 epochs │ 32 optimizer steps" in text and "1024 samples │ 8 optimizer" in text
    assert "data.train_size" not in err
    plan = yaml.safe_load((tmp_path / "plan.yaml").read_text())
    assert (plan["dataset_size"], plan["schedule"]["end_step"], plan["schedule"]["warmup_steps"]) == (1024, 32, 8)
    code, printed, err = cli(capsys, "run", tmp_path / "plan.yaml", "--out", tmp_path / "out", "--device", "cpu",
                             "--max-steps", "2")
    assert code == 0, err
    assert "done: 2 steps" in printed


def test_a_plan_file_made_without_the_data_size_runs_and_never_says_none(tmp_path, capsys):
    from reproduce.plan.planfile import save_plan
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import load_recipe

    # a plan file with no data size, as `make_plan` can no longer write one (it refuses epochs of an unknown size)
    sized = make_plan(load_recipe(OWN / "recipe.yaml"), 32, dataset_size=1024)
    unsized = {"dataset_size": None, "steps_per_epoch": None}
    schedule = sized.schedule.model_copy(update={"end_step": None, "warmup_steps": 0, "decay_end_step": None,
                                                 "decay_milestones": []})
    blind = sized.model_copy(update={**unsized, "schedule": schedule,
                                     "segments": [sized.segments[0].model_copy(update=unsized)]})
    save_plan(blind, tmp_path / "plan.yaml")
    code, printed, err = cli(capsys, "run", tmp_path / "plan.yaml", "--out", tmp_path / "out", "--device", "cpu",
                             "--max-steps", "2")
    assert code == 0, err
    assert "None" not in printed + err and "training 2 optimizer steps" in printed
    saved = yaml.safe_load((tmp_path / "out" / "plan.yaml").read_text())
    assert (saved["dataset_size"], saved["schedule"]["end_step"]) == (1024, 32)


def test_a_size_that_is_truly_unknown_names_data_train_size_never_none_or_step_0(tmp_path, capsys):
    recipe = dict(DIGITS, data={"name": "my-corpus", "available": False},
                  schedule={"warmup": {"epochs": 1}, "decay": {"kind": "cosine"}, "total": {"epochs": 3}})
    out = tmp_path / "plan.yaml"
    code, printed, err = cli(capsys, "plan", write(tmp_path / "r.yaml", recipe), "--micro-batch-max", "16",
                             "--out", out)
    assert code == 2 and not out.exists()
    assert err.count("\n") == 1 and err.startswith("error: ") and "data.train_size: required" in err
    assert "None" not in printed + err and "step 0" not in printed + err


# ---- 12. factories beside the recipe or check file -----------------------------------------------------------

FACTORY_CODE = '''
import torch
from torch.utils.data import TensorDataset


def data(items: int = 96):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(items, 8, generator=generator)
    return {"train": TensorDataset(inputs, (inputs.sum(1) > 0).long())}


def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
'''


def project(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """recipes/{name}_data.py + recipes/recipe.yaml, and checks/{name}_model.py + checks/check.yaml naming it."""
    (tmp_path / "recipes").mkdir(parents=True)
    (tmp_path / "checks").mkdir()
    (tmp_path / "recipes" / f"{name}_data.py").write_text(FACTORY_CODE)
    (tmp_path / "checks" / f"{name}_model.py").write_text(FACTORY_CODE)
    recipe = dict(DIGITS, model={"factory": f"{name}_data:model"}, data={"factory": f"{name}_data:data"},
                  schedule={"total": {"epochs": 2}})
    write(tmp_path / "recipes" / "recipe.yaml", recipe)
    check = {"recipe": "../recipes/recipe.yaml", "budget": {"micro_batch_max": 16},
             "runs": {"other-model": {"overrides": {"model": {"factory": f"{name}_model:model"}}}},
             "checks": [{"kind": "plan", "expect": {"steps_per_epoch": 1, "optimizer_steps": 2}},
                        {"kind": "verify", "run": "other-model", "samples": 32}]}
    (tmp_path / "checks" / "check.yaml").write_text(yaml.safe_dump(check))
    return tmp_path / "recipes" / "recipe.yaml", tmp_path / "checks"


def test_factories_are_imported_from_the_recipes_and_check_files_folders(tmp_path, capsys, monkeypatch):
    recipe, checks = project(tmp_path / "project", "first_hour_twelve")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, printed, err = cli(capsys, "plan", recipe, "--micro-batch-max", "16")
    assert code == 0, err
    assert "2 optimizer steps" in " ".join(printed.split())
    code, printed, err = cli(capsys, "check", checks, "--work", tmp_path / "work")
    assert code == 0, printed + err
    assert "2 passed" in printed


def test_a_factory_that_is_nowhere_names_the_folders_searched(tmp_path, capsys, monkeypatch):
    recipe, _ = project(tmp_path / "project", "first_hour_twelve_b")
    (tmp_path / "project" / "recipes" / "first_hour_twelve_b_data.py").unlink()
    monkeypatch.chdir(tmp_path)
    line = refused(capsys, tmp_path, "run", recipe, "--out", tmp_path / "out", "--device", "cpu",
                   "--micro-batch-max", "16")
    assert line.startswith("error: data.factory: cannot import 'first_hour_twelve_b_data': no module "
                           "'first_hour_twelve_b_data' in ")
    assert str(tmp_path / "project" / "recipes") in line and str(tmp_path) in line
    assert line.endswith("(the recipe's or check file's folder, then the working directory) or on PYTHONPATH")


# ---- 13. the worked example of docs/own-model.md, each command as the page shows it ------------------------------

def test_the_own_model_walkthrough_runs_as_documented(tmp_path, capsys, monkeypatch):
    import shutil

    page = (ROOT / "docs" / "own-model.md").read_text()
    commands = [line[2:] for line in page.splitlines() if line.startswith("$ reproduce ")]
    assert [shlex.split(c)[1] for c in commands] == ["plan", "verify", "run", "check"]
    shutil.copytree(OWN, tmp_path / "examples" / "own-model")  # a fresh copy: the page's relative paths
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path / "cache"))  # the probe measures, as on a first use
    printed = {}
    for command in commands:
        code, out, err = cli(capsys, *shlex.split(command)[1:])
        assert code == 0, f"{command}\n{out}\n{err}"
        printed[shlex.split(command)[1]] = " ".join((out + err).split())
    assert "32 x 4 x 1 = 128 samples exact" in printed["plan"] and "32 optimizer steps" in printed["plan"]
    assert "1024 samples │ 8 optimizer steps" in printed["plan"]  # the size from the data factory
    assert "probe: largest micro-batch " in printed["plan"] and (tmp_path / "own-plan.yaml").is_file()
    assert "the plan's 4 micro-batch(es) give the one-pass gradient within 1e-10" in printed["verify"]
    assert "done: 32 steps" in printed["run"] and "the paper reports top1_accuracy 0.957 +- 0.02 (95.7 +- 2%) on val " \
        "at step 32; this run ran all 32 steps" in printed["run"]
    final = re.search(r"eval accuracy (0\.\d+), .* eval top-1 accuracy (0\.\d+);", printed["run"])
    assert final and float(final[1]) == pytest.approx(float(final[2]), abs=1e-3)  # the same scale on both lines
    assert "6 passed, 0 failed" in printed["check"]
    summary = json.loads((tmp_path / "runs" / "own" / "summary.json").read_text())
    assert summary["final"]["eval_accuracy"] >= 0.9 and summary["noise_scale"]["verdict_from"] == "final"
