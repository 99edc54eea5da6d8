"""The recipe's gates (plan/gates.py) checked as the run goes: at a gate's step its metric passes, warns, or
pauses the run (checkpointed, kept as checkpoints/gate-NAME.pt, one line, exit status 4). Resumed, a paused gate is
checked again unless accepted; `--resume --from NAME` starts from a gate's checkpoint. The watch's state travels in
the checkpoint's `extra["gates"]`, so a resume checks what the uninterrupted run would.
"""

from __future__ import annotations

import shutil
import statistics
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from ..errors import GatePaused, UserError
from ..observe.reference import REFERENCE_GATE, reference_curve
from ..plan.gates import EXIT_PAUSED, PlannedGate, gate_by_name, outcome_line, planned_gates
from ..storage.files import write_atomic
from .distributed import processes as distributed
from .evaluation import evaluate_after
from .reporter import StepRecord

__all__ = ["EXIT_PAUSED", "GatePaused", "GateWatch", "gate_checkpoint"]

PACE_STEPS = 20  # the forecast's pace: the median wall time of the last this many steps


def gate_checkpoint(out: Path, name: str) -> Path:
    """Where a gate's checkpoint is kept: beside last.pt, under the gate's name, never overwritten by last.pt."""
    return out / "checkpoints" / f"gate-{name}.pt"


class GateWatch:
    """The gates of one run, and what it has measured for them."""

    def __init__(self, plan: Any, accept: tuple[str, ...] = ()):
        # the most GPU-hours the recipe's `budget:` allows: `gpu_hours`, or `money` at its `price` per GPU-hour (the
        # smaller when both are given); none without a budget in GPU-hours
        budget = getattr(plan.recipe, "budget", None)
        bounds = [budget.gpu_hours] if budget is not None and budget.gpu_hours is not None else []
        if budget is not None and budget.money is not None and budget.price is not None:
            bounds.append(budget.money / budget.price)
        self.planned = planned_gates(plan, float(min(bounds)) if bounds else None)
        for name in accept:
            gate_by_name(self.planned, name, "accept_gate")
        self.accept = set(accept)
        self.planned_steps = plan.optimizer_steps
        longest = max([gate.gate.smooth for gate in self.planned], default=1)
        self.losses: deque[float] = deque(maxlen=longest)
        self.rates: deque[dict] = deque(maxlen=longest)
        self.seconds: deque[float] = deque(maxlen=PACE_STEPS)
        self.outcomes: dict[str, dict] = {}  # gate name -> its event (the last check)
        self.paused: str | None = None  # the gate the run paused at (from its checkpoint)
        self.held: dict[str, dict] = {}  # the cost gate's last check while it held
        self.reference: Any = None  # the reference runs' curve (observe/reference.py), whose state travels here

    def state_dict(self) -> dict:
        return {"reference": self.reference.state_dict() if self.reference is not None else {},
                "losses": list(self.losses), "rates": list(self.rates), "seconds": list(self.seconds),
                "outcomes": dict(self.outcomes), "paused": self.paused}

    def load_state_dict(self, state: dict) -> None:
        self.losses.extend(state.get("losses", []))
        self.rates.extend(state.get("rates", []))
        self.seconds.extend(state.get("seconds", []))
        self.outcomes.update(state.get("outcomes", {}))
        self.paused = state.get("paused")
        if self.reference is not None:
            self.reference.load_state_dict(state.get("reference", {}))

    def due(self, step: int) -> list[PlannedGate]:
        """The gates due after step `step` (from 1): those at it, and the cost gate until it has missed."""
        return [gate for gate in self.planned
                if (gate.step == step and not gate.every_step)
                or (gate.every_step and step >= gate.step and gate.name not in self.outcomes)]

    def observe(self, record: dict) -> None:
        """A step's record: its loss, rates and wall time, for the smoothed values and the pace."""
        loss = record.get("loss")
        if isinstance(loss, float) and loss == loss and abs(loss) != float("inf"):
            self.losses.append(loss)
        self.rates.append({key: record[key] for key in ("samples_per_second", "tokens_per_second") if key in record})
        self.seconds.append(float(record.get("seconds", 0.0)))

    def value(self, gate: PlannedGate, step: int, record: dict, spent_seconds: float, world_size: int
              ) -> float | None:
        """The gate's metric after step `step`: None when the run did not measure it (no evaluation data)."""
        metric, smooth = gate.gate.metric, gate.gate.smooth
        if metric in ("loss", "samples_per_second", "tokens_per_second"):  # the mean of the last `smooth` steps'
            recent = (list(self.losses)[-smooth:] if metric == "loss" else
                      [rates[metric] for rates in list(self.rates)[-smooth:] if metric in rates])
            return sum(recent) / len(recent) if recent else None
        if metric == "gpu_hours":
            return spent_seconds * world_size / 3600
        if metric == "forecast_gpu_hours":
            left = max(0, (self.planned_steps or step) - step)
            pace = statistics.median(self.seconds) if self.seconds else 0.0
            return (spent_seconds + left * pace) * world_size / 3600
        if metric == "eval_error":
            return 1 - record["eval_accuracy"] if "eval_accuracy" in record else None
        value = record.get(metric)
        return float(value) if isinstance(value, (int, float)) else None

    def check(self, step: int, record: dict, spent_seconds: float, world_size: int,
              agree: Any = None) -> list[dict]:
        """The events of the gates due after `step`: each value against its bound, and its status; the
        cost gate says nothing while it holds."""
        events = []
        for gate in self.due(step):
            value = self.value(gate, step, record, spent_seconds, world_size)
            if gate.every_step and agree is not None:  # every rank takes the slowest rank's forecast: one decision
                value = agree(value or 0.0)
            held = value is not None and gate.gate.holds(value)
            if gate.every_step and held:  # the cost gate while it holds: its last value, for the summary
                self.held[gate.name] = {"status": "held", "value": round(value or 0.0, 8), "step": step}
                continue
            # a metric the run cannot measure (no evaluation data) neither passes nor pauses: it is said so
            status = ("passed" if held else "not measured" if value is None else "accepted" if gate.name in
                      self.accept else "warned" if gate.gate.action == "warn" else "paused")
            event = {"event": "gate", "step": step, "name": gate.name, "metric": gate.gate.metric,
                     "value": None if value is None else round(value, 8), "bound": gate.gate.bound_label(),
                     "action": gate.gate.action, "status": status, "source": gate.gate.source}
            self.outcomes[gate.name] = event
            events.append(event)
        paused = [event["name"] for event in events if event["status"] == "paused"]
        self.paused = paused[0] if paused else None
        return events

    def summary(self) -> list[dict]:
        """summary.json's `gates`: each planned gate at its step, with its outcome when the run reached it."""
        rows = []
        for gate in self.planned:
            outcome = self.outcomes.get(gate.name)
            if gate.every_step and outcome is None:
                outcome = self.held.get(gate.name)
            rows.append({"name": gate.name, "step": gate.step, "metric": gate.gate.metric,
                         "bound": gate.gate.bound_label(), "action": gate.gate.action, "source": gate.gate.source,
                         "status": outcome["status"] if outcome else "not reached",
                         **({"value": outcome.get("value"), "checked_at": outcome.get("step")} if outcome else {})})
        return rows


def paused_line(event: dict, out: Path, kept: Path | None, continue_with: str) -> str:
    """The pause's one line: the gate, measured against its bound, its checkpoint, and the two ways on."""
    where = f"checkpoint {kept}" if kept else f"checkpoint {out / 'checkpoints' / 'last.pt'}"
    return (f"{outcome_line(event, status=False)}; {where}. Go on: fix the cause and resume ({continue_with}), or "
            f"accept this gate ({continue_with} --accept-gate {event['name']})")


def resume_source(out: Path, name: str, planned: list[PlannedGate]) -> Path:
    """The checkpoint a run resumed `--from NAME` loads (instead of last.pt): the kept checkpoint of gate NAME."""
    gate_by_name(planned, name, "resume_from")
    path = gate_checkpoint(out, name)
    if not path.is_file():
        raise UserError(f"gate {name!r} has no checkpoint in {out / 'checkpoints'} (the run has not reached it)",
                        field="resume_from")
    return path


def start_gates(run: Any) -> None:
    """The run's gate watch (None without gates), resumed from the checkpoint; a gate the run paused at
    is checked again now, unless accepted."""
    run.reference = reference_curve(run.plan.recipe, run.request.reference)
    extra = (REFERENCE_GATE,) if run.reference is not None else ()
    watch = GateWatch(run.plan, tuple(name for name in run.request.accept_gate if name not in extra))
    if not watch.planned and run.reference is None:
        return
    watch.accept |= set(run.request.accept_gate)
    watch.reference = run.reference
    run.gates = watch
    data = run.setup.data
    for gate in watch.planned:
        if gate.evaluated and (data.eval is None or len(data.eval) == 0) and run.world.is_main:
            run.reporter.message(f"note: gate {gate.name}: {gate.gate.metric} is measured on evaluation data, and "
                                 "this run has none (data.eval_path, or `eval_data`): it will say 'not measured'")
    state = run.resumed.state
    if state is None:
        return
    watch.load_state_dict(state["extra"].get("gates", {}))
    name = watch.paused
    if name is None:
        return
    if name == REFERENCE_GATE:  # its band missed: going on is accepting it
        if name not in watch.accept:
            raise GatePaused(paused_line(watch.outcomes[name], run.out, gate_checkpoint(run.out, name),
                                         run.continue_with))
        watch.outcomes[name] = {**watch.outcomes[name], "status": "accepted"}
        watch.paused = None
        tell_gates(run, [watch.outcomes[name]])
        return
    step = run.resumed.first_step
    gate = gate_by_name(watch.planned, name, "accept_gate")
    watch.outcomes.pop(name, None)
    record = dict(run.last_record)
    if gate.evaluated:
        record.update(evaluate_after(run, step - 1))
    event = watch.check(step, record, run.totals_before_resume["seconds"], run.world.size)
    event = [e for e in event if e["name"] == name]
    tell_gates(run, event)
    pause(run, watch.paused is not None, event if run.world.is_main else [], gate_checkpoint(run.out, name))


def pause(run: Any, paused: bool, events: list[dict], kept: Path | None) -> None:
    """When a gate `paused` the run on any rank: every rank stops, the one with the pause's `events` saying which."""
    if distributed.any_rank(run.world, paused, run.setup.device):
        distributed.barrier(run.world)  # every rank here before any leaves the group (else gloo aborts one)
        if not events:
            raise GatePaused("a gate paused the run (rank 0 says which)")
        raise GatePaused(paused_line(events[0], run.out, kept, run.continue_with))


def check_gates(run: Any, step: int, record: StepRecord) -> list[dict]:
    """After step `step` (from 0): the gates due, measured (evaluating first when a gate needs it); their
    events are written after the step's record by `tell_gates`."""
    watch = run.gates
    if watch is None:
        return []
    watch.observe(record.line())
    due = bool(watch.due(step + 1))  # the same on every rank
    found = run.reference.check(step + 1, record.line()) if run.reference is not None else None
    if found is not None:
        if found["status"] == "paused" and REFERENCE_GATE in watch.accept:
            found["status"] = "accepted"
        watch.outcomes[found["name"]] = found
    events = []
    gates_due = watch.due(step + 1)  # (after the reference's outcome, as watch.check reads them)
    if gates_due:
        if any(gate.evaluated for gate in gates_due) and "eval_loss" not in record.evaluation:
            record.evaluation.update(evaluate_after(run, step))
        spent = run.totals_before_resume["seconds"] + time.perf_counter() - run.started
        # every rank takes the largest forecast (each times its own steps)
        agree = (lambda value: distributed.reduced(run.world, value, torch.distributed.ReduceOp.MAX,
                                                   run.setup.device, torch.float64)) if run.world.distributed else None
        events = watch.check(step + 1, record.line(), spent, run.world.size, agree)
    if found is not None:
        events.append(found)
        if found["status"] == "paused":  # (after watch.check, which sets its own gates' pause)
            watch.paused = found["name"]
    if events:
        record.gates = {event["name"]: event["status"] for event in events}
    # several processes: rank 0 alone evaluates, so the ranks agree on whether this step checkpoints for a gate (a
    # rank with no event of its own takes a placeholder, which it neither writes nor tells)
    if run.world.distributed and (due or run.reference is not None):
        if distributed.any_rank(run.world, bool(events), run.setup.device) and not events:
            events = [{"event": "gate", "step": step + 1, "name": "", "status": "elsewhere"}]
    return events


def after_checkpoint(run: Any, events: list[dict]) -> None:
    """After the gate step's checkpoint: keep it under each gate's name, then pause when a gate says so."""
    if not events:
        return
    kept = None  # (a sharded run's model is in a folder last.pt names: not kept per gate)
    for event in events:
        if run.world.is_main and event["status"] != "elsewhere" and not run.setup.sharded:
            kept = gate_checkpoint(run.out, event["name"])
            with open(run.out / "checkpoints" / "last.pt", "rb") as sealed:  # its bytes, seal included
                write_atomic(kept, lambda handle: shutil.copyfileobj(sealed, handle))
    paused = [event for event in events if event["status"] == "paused"]
    pause(run, bool(paused), paused, gate_checkpoint(run.out, paused[0]["name"]) if paused and kept else None)


def tell_gates(run: Any, events: list[dict]) -> None:
    """Each gate's event into metrics.jsonl and to the reporter."""
    for event in events:
        run.metrics.write(event)
    say = getattr(run.reporter, "gate", None) or (lambda event: run.reporter.message(outcome_line(event)))
    for event in events if run.world.is_main else []:
        say(event)
