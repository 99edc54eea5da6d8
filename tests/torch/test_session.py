"""The core session layer (reproduce/session.py, plan/resume_rules.py): probe then plan, the probe consensus across
ranks and the resume rules, as values: the lines to show come back as data, nothing is printed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from core_helpers import make_recipe
from reproduce.errors import MicroBatchError, UserError
from reproduce.plan.overlay import Change, overlay
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.probe.runner import ProbeOptions, probe_line
from reproduce.session import plan_and_probe, probe_consensus, run_plan

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "papers" / "digits-mlp.yaml"
ESTIMATE = ProbeOptions(memory="44MiB", meter="estimate", headroom=0.0, use_cache=False)
PHASES = ROOT / "papers" / "pysource-gpt-phases.yaml"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path / "cache"))


def test_probe_then_plan_returns_its_lines_and_prints_nothing(capfd):
    heard: list[str] = []
    planned = plan_and_probe(load_recipe(DIGITS), str(DIGITS), None, 1, "exact", probe=ESTIMATE,
                             on_note=heard.append)
    assert planned.probe is not None and planned.plan.micro_batch_max == planned.probe.micro_batch_max
    assert heard == [probe_line(planned.probe)]
    assert heard[0].startswith(f"probe: largest micro-batch {planned.probe.micro_batch_max} (")
    out, err = capfd.readouterr()
    assert out == err == ""


def test_a_given_maximum_probes_nothing():
    heard: list[str] = []
    planned = plan_and_probe(load_recipe(DIGITS), str(DIGITS), 16, 1, "exact", on_note=heard.append)
    assert planned.probe is None and heard == [] and planned.plan.micro_batch == 16


def test_a_memory_given_beside_a_maximum_is_said_to_be_unused(capfd):
    """`memory` beside `micro_batch_max`: nothing is probed for it (nor the token budget searched, nor the ways
    timed), one line says so; a `gpu` beside it names the card the time is predicted for, and says nothing here."""
    heard: list[str] = []
    planned = plan_and_probe(load_recipe(DIGITS), str(DIGITS), 16, 1, "exact", probe=ESTIMATE, on_note=heard.append)
    assert planned.probe is None and planned.plan.micro_batch_max == 16
    assert heard == [
        "`memory` 44MiB: not used: `micro_batch_max` was given, so nothing was probed (the micro-batch; the token "
        "budget, the micro-batch x the longest example, not searched; the ways to group the data, not timed); leave "
        "`micro_batch_max` out to probe for that memory"]
    for options in (ProbeOptions(gpu="a100-80gb", meter="estimate"), None):
        heard.clear()
        plan_and_probe(load_recipe(DIGITS), str(DIGITS), 16, 1, "exact", probe=options, on_note=heard.append)
        assert heard == []
    assert capfd.readouterr() == ("", "")


def test_batch_phases_probe_each_sequence_length_and_plan_each_phase_with_its_own_maximum():
    """128 sequences of 32 tokens, then 64 of 64: each length probed at its largest batch, in order, the main
    length's (64) result kept; the plan's phases take each length's maximum, as given ones would."""
    heard: list[str] = []
    probe = ProbeOptions(memory="120MiB", meter="estimate", headroom=0.0, use_cache=False)
    planned = plan_and_probe(load_recipe(PHASES), str(PHASES), None, 1, "exact", probe=probe, on_note=heard.append)
    assert [line.split(": probe: ")[0] for line in heard] == [
        "sequence length 32", "sequence length 64"]
    assert planned.probe is not None and heard[1] == f"sequence length 64: {probe_line(planned.probe)}"
    found = [int(line.split("largest micro-batch ")[1].split()[0]) for line in heard]
    maxima = dict(zip((32, 64), found, strict=True))
    assert found[0] < 128 and found[1] < 64  # (below each phase's batch: not capped by it)
    assert [(s.sequence_length, s.micro_batch_max) for s in planned.plan.segments] == list(maxima.items())
    given = make_plan(load_recipe(PHASES), maxima, 1, recipe_path=str(PHASES))
    assert planned.plan.model_dump() == given.model_dump()


def test_batch_phases_in_epochs_probe_with_the_data_size_given(tmp_path):
    """A schedule and a phase counted in epochs: each length's check plan counts its steps from the run's data size
    (per sequence length), as the plan does; without it the probe refused a run that has its data."""
    text = PHASES.read_text().replace("total: {steps: 300}", "total: {epochs: 3}")
    in_epochs = tmp_path / "phases-epochs.yaml"
    in_epochs.write_text(text.replace("{steps: 200, effective", "{epochs: 2, effective"))
    probe = ProbeOptions(memory="120MiB", meter="estimate", headroom=0.0, use_cache=False)
    sizes = {32: 6000, 64: 3000}
    planned = plan_and_probe(load_recipe(in_epochs), str(in_epochs), None, 1, "exact", sizes, probe=probe)
    maxima = {s.sequence_length: s.micro_batch_max for s in planned.plan.segments}
    given = make_plan(load_recipe(in_epochs), maxima, 1, dataset_size=sizes, recipe_path=str(in_epochs))
    assert planned.plan.model_dump() == given.model_dump()
    assert [s.steps for s in planned.plan.segments] == [2 * (6000 // 128), None]  # (2 epochs at 32, then one at 64)
    assert planned.plan.optimizer_steps == 2 * (6000 // 128) + 3000 // 64


def test_a_probe_error_that_names_the_micro_batch_maximum_is_passed_on_as_it_is():
    """A micro-batch of 1 under DeepLabV3's pooled BatchNorm (an effective batch of 1): the plan the probe builds
    its step from refuses it, naming `micro_batch_max`; the probe adds no hint to give one."""
    recipe = overlay(load_recipe(ROOT / "papers" / "chen2017-deeplabv3.yaml"), [Change("batch.effective", 1)], "r")
    with pytest.raises(MicroBatchError) as raised:
        plan_and_probe(recipe, "r.yaml", None, 1, "exact", probe=ProbeOptions(gpu="a100-80gb", meter="estimate"))
    assert raised.value.lines[-1].endswith("give `micro_batch_max` 2 or more, or `model.batchnorm` group | frozen")


def test_the_probe_consensus_takes_the_smallest_maximum_of_the_ranks():
    """Each rank's maximum goes through `all_min`; here the other rank's device fits 3."""
    seen: list[int] = []

    def all_min(maximum: int) -> int:
        seen.append(maximum)
        return min(maximum, 3)

    recipe, agreed = probe_consensus(load_recipe(DIGITS), str(DIGITS), 2, "exact", None, all_min, probe=ESTIMATE)
    assert seen and seen[0] > 3 and agreed == 3
    assert make_plan(recipe, agreed, 2).micro_batch_max == 3


def test_a_resumed_plan_is_replanned_for_a_smaller_micro_batch_with_the_same_steps():
    recipe = make_recipe()
    saved = make_plan(recipe, 32, 1, dataset_size=1000)
    again, warnings = run_plan(recipe, "r.yaml", saved, 16, 1, "exact", 1000, resume=True)
    assert (again.micro_batch, again.accumulation_steps) == (16, 8)
    assert (again.effective_batch, again.optimizer_steps) == (saved.effective_batch, saved.optimizer_steps)
    assert warnings == list(again.warnings)
    _, warnings = run_plan(recipe, "r.yaml", saved, None, 1, "exact", 900, resume=False)
    assert "data.train_size is 1000; the data has 900: using 900" in warnings


def test_a_plan_that_cannot_be_kept_on_another_world_size_says_so():
    saved = make_plan(make_recipe(), 32, 1, dataset_size=1000)
    with pytest.raises(UserError, match="r.yaml: world_size: the plan .* cannot be kept on 3 processes"):
        run_plan(saved.recipe, "r.yaml", saved, None, 3, "exact", 1000, resume=True)


def test_plan_with_a_given_maximum_imports_no_torch():
    code = ("import sys; from reproduce.cli import main\n"
            f"try:\n    main(['plan', {str(DIGITS)!r}, '--micro-batch-max', '16'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stderr.strip().splitlines()[-1] == "False" and "16 x" in done.stdout
