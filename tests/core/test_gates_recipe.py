"""The recipe's `gates:` section: its forms, its one-line errors, and each gate's `at` in optimizer steps."""

from __future__ import annotations

import pytest

from core_helpers import make_recipe
from reproduce.errors import UserError
from reproduce.plan.gates import EXIT_PAUSED, outcome_line, planned_gates
from reproduce.plan.planner import make_plan

EARLY = {"name": "early", "at": {"step": 20}, "metric": "loss", "max": 1.0, "action": "pause"}


def gates(*items, **overrides):
    return make_recipe(gates=list(items), **overrides)


def test_the_issues_form_works_as_written():
    recipe = gates(EARLY)
    gate = recipe.gates[0]
    assert (gate.name, gate.at.step, gate.metric, gate.max, gate.min, gate.action) == ("early", 20, "loss", 1.0,
                                                                                       None, "pause")
    assert gate.holds(0.99) and gate.holds(1.0) and not gate.holds(1.01)


def test_min_band_epoch_fraction_and_source():
    recipe = gates({"name": "acc", "at": {"epoch": 2}, "metric": "eval_accuracy", "min": 0.5, "action": "warn",
                    "source": "Fig. 2 [P]"},
                   {"name": "band", "at": {"fraction": 0.5}, "metric": "eval_loss", "min": 0.1, "max": 0.9},
                   {"name": "plural", "at": {"steps": 3}, "metric": "samples_per_second", "min": 1})
    assert recipe.gates[0].bound_label() == ">= 0.5" and recipe.gates[0].source == "Fig. 2 [P]"
    assert recipe.gates[1].bound_label() == "within [0.1, 0.9]"
    assert not recipe.gates[1].holds(0.95) and not recipe.gates[1].holds(0.05) and recipe.gates[1].holds(0.5)
    assert recipe.gates[2].at.unit == "step" and recipe.gates[2].at.value == 3


@pytest.mark.parametrize("gate, message", [
    ({**EARLY, "metric": "los"}, "test: gates.0.metric: unknown metric 'los' for task classification"),
    ({**EARLY, "at": {"step": 2, "epoch": 1}}, "test: gates.0.at: give exactly one of step, epoch, fraction"),
    ({**EARLY, "max": None}, "test: gates.0: give max (the metric must be at most), min (at least), or both"),
    ({**EARLY, "min": 2.0}, "test: gates.0: min 2 is above max 1"),
    ({**EARLY, "action": "stop"}, "test: gates.0.action: expected one of 'warn' or 'pause'"),
    ({**EARLY, "name": "a b"}, "test: gates.0.name: expected letters, digits"),
    ({**EARLY, "at": {"fraction": 1.5}}, "test: gates.0.at.fraction: must be <= 1"),
    ({**EARLY, "maximum": 1}, "test: gates.0.maximum: unknown key"),
])
def test_a_bad_gate_is_one_line(gate, message):
    with pytest.raises(UserError) as error:
        gates(gate)
    assert len(error.value.lines) == 1 and error.value.lines[0].startswith(message), error.value.lines


def test_two_gates_of_one_name_are_refused():
    with pytest.raises(UserError, match="gates.1.name: 'early' names two gates"):
        gates(EARLY, EARLY)


def test_each_gate_at_its_optimizer_step():
    # BASE: 1,000 samples, batch 128 -> 7 steps an epoch (drop_last), 10 epochs = 70 optimizer steps
    recipe = gates({"name": "step", "at": {"step": 20}, "metric": "loss", "max": 3},
                   {"name": "epoch", "at": {"epoch": 2}, "metric": "eval_loss", "max": 3},
                   {"name": "half", "at": {"fraction": 0.5}, "metric": "eval_accuracy", "min": 0.1},
                   {"name": "samples", "at": {"samples": 1280}, "metric": "loss", "max": 3})
    plan = make_plan(recipe, micro_batch_max=32)
    planned = {gate.name: gate.step for gate in planned_gates(plan)}
    assert plan.optimizer_steps == 70
    assert planned == {"step": 20, "epoch": 14, "half": 35, "samples": 10}
    assert [gate.step for gate in planned_gates(plan)] == sorted(planned.values())  # in the order the run meets them
    line = planned_gates(plan)[1].line()
    assert line == "gate epoch: eval_loss <= 3 at step 14 (epoch 2), pause"


def test_a_gate_past_the_run_is_refused_at_plan_time():
    with pytest.raises(UserError, match=r"gates.0.at: step 71 past the run's 70 optimizer steps"):
        make_plan(gates({**EARLY, "at": {"step": 71}}), micro_batch_max=32)
    with pytest.raises(UserError, match=r"gates.0.at: epoch 11 is optimizer step 77, past the run's 70"):
        make_plan(gates({**EARLY, "at": {"epoch": 11}}), micro_batch_max=32)


def test_the_budget_is_a_cost_gate():
    recipe = make_recipe(gates=[EARLY], budget={"gpu_hours": 2.0})
    plan = make_plan(recipe, micro_batch_max=32)
    cost = planned_gates(plan, 2.0)[-1]
    assert (cost.name, cost.gate.metric, cost.gate.max, cost.every_step) == ("budget", "forecast_gpu_hours", 2.0,
                                                                              True)
    with pytest.raises(UserError, match="'budget' is the budget's cost gate's"):
        planned_gates(make_plan(gates({**EARLY, "name": "budget"}), micro_batch_max=32), 2.0)


def test_the_outcome_line_and_the_exit_status():
    event = {"name": "early", "step": 20, "metric": "loss", "value": 2.3125, "bound": "<= 1", "status": "paused",
             "source": None}
    assert outcome_line(event) == "gate early at step 20: loss 2.3125 misses <= 1: paused"
    passed = {**event, "value": 0.5, "status": "passed"}
    assert outcome_line(passed) == "gate early at step 20: loss 0.5 meets <= 1: passed"
    assert EXIT_PAUSED == 4


def test_plan_prints_the_gates(capsys, tmp_path):
    import yaml

    from core_helpers import BASE, cli

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**BASE, "gates": [EARLY]}))
    code, out, err = cli(capsys, "plan", path, "--micro-batch-max", "32")
    assert code == 0, err
    assert "gate early: loss <= 1 at step 20, pause" in out
    path.write_text(yaml.safe_dump({**BASE, "gates": [{**EARLY, "at": {"step": 700}}]}))
    code, out, err = cli(capsys, "plan", path, "--micro-batch-max", "32")
    assert code == 2 and err.strip().startswith("error: ") and "gates.0.at: step 700 past the run's 70" in err


def test_the_reference_section():
    recipe = make_recipe(reference={"runs": "runs/a", "band": 0.05})
    assert recipe.reference.runs == ["runs/a"] and recipe.reference.band == 0.05 and recipe.reference.action == "warn"
    assert make_recipe(reference={"runs": ["runs/a", "runs/b"]}).reference.spread == 3.0  # the seed spread's band
    assert make_recipe(reference={"band": 0.1}).reference.runs == []  # the runs from --reference
    with pytest.raises(UserError, match="reference.runs: one reference run gives no seed spread; give band"):
        make_recipe(reference={"runs": ["runs/a"]})
    with pytest.raises(UserError, match="reference.metric: expected one of 'loss' or 'eval_loss'"):
        make_recipe(reference={"runs": ["runs/a"], "band": 0.1, "metric": "accuracy"})
