"""The ways to group the data timed (throughput/ways.py) on one model, interleaved, each through its run's attention,
and the plan's cost taken from the way the run will use (throughput/cost.py), on a real LLaMA with LoRA over
the sample instructions (one thread)."""

from __future__ import annotations

import time

import pytest
import torch

from helpers import INSTRUCTIONS_LLAMA, instructions_recipe
from reproduce.models import varlen
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.runner import ProbeResult, ProbeTrial
from reproduce.probe.workload import Workload
from reproduce.throughput import split_steps
from reproduce.throughput.cost import cost_lines, plan_costs
from reproduce.throughput.ways import WayTimings, clock, time_ways

WAIT = 0.3  # seconds the `none` way waits in each timed call (no CPU time)


def test_the_ways_are_timed_interleaved_on_one_model_each_through_its_runs_attention(sample_data, one_thread,
                                                                                     monkeypatch):
    """One model built for all three ways; a warm-up step of each on the first window, then passes that time every
    way once on the same windows (the order rotated each pass); packed through the varlen attention, none and sorted
    through transformers' sdpa (as their runs build them); each way's least pass kept, by the process's CPU time on
    the CPU: `none` waiting 0.3 s in each of its calls (as for a core under load: wall clock, no CPU time) is ranked
    without the wait, and its wall clock (the plan's cost) keeps it."""
    built, calls = [], []
    init, call = split_steps.SplitSteps.__init__, split_steps.SplitSteps.__call__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    def recording_call(self, micro_batch, count):
        before, window = varlen.CALLS["cut"], self.taken[micro_batch]
        seconds = call(self, micro_batch, count)
        way = self.grouping.way if self.grouping is not None else "none"
        if way == "none":
            time.sleep(WAIT)
            seconds += WAIT
        calls.append((way, count, window, varlen.CALLS["cut"] > before, varlen.attention_of(self.setup.model),
                      seconds))
        return seconds

    monkeypatch.setattr(split_steps.SplitSteps, "__init__", counting_init)
    monkeypatch.setattr(split_steps.SplitSteps, "__call__", recording_call)
    recipe = parse_recipe(instructions_recipe(sample_data))
    data = Workload(recipe).data
    timings = time_ways(recipe, ["none", "sorted", "packed"], 2, 16, data, torch.device("cpu"), steps=1, passes=3)
    assert len(built) == 1
    assert [(way, count, window) for way, count, window, *_ in calls] == [
        ("none", 1, 0), ("sorted", 1, 0), ("packed", 1, 0),  # the warm-ups, on the first window
        ("none", 1, 1), ("sorted", 1, 1), ("packed", 1, 1),  # then the same timed window in each pass, rotated
        ("sorted", 1, 1), ("packed", 1, 1), ("none", 1, 1),
        ("packed", 1, 1), ("none", 1, 1), ("sorted", 1, 1)]
    for way, _, _, cut, attention, _ in calls:
        assert (cut, attention) == ((True, varlen.VARLEN) if way == "packed" else (False, "sdpa"))
    assert timings.clock == "cpu"
    for way in ("none", "sorted", "packed"):
        walls = [s for w, count, window, *_, s in calls if w == way and window == 1]
        assert timings.wall[way] in walls
        assert timings.seconds[way] <= timings.wall[way] + 0.01
    assert timings.wall["none"] >= WAIT and timings.seconds["none"] < timings.wall["none"] - 0.8 * WAIT
    assert timings.chosen == min(timings.seconds, key=timings.seconds.get)
    assert timings.line().startswith(f"packing: {timings.chosen}, the fastest exact way measured here: target tokens "
                                     "per CPU second (the process's CPU time) over the same 1 steps, the least of 3 "
                                     "interleaved passes: none ")
    measured = timings.to_json()
    assert measured["ranked_by"] == "cpu" and measured["measured"].startswith("the process's CPU seconds of whole")
    assert measured["ways"]["packed"]["step_seconds"] == pytest.approx(timings.wall["packed"], abs=1e-6)
    assert measured["ways"]["none"]["target_tokens_per_cpu_second"] == pytest.approx(
        timings.tokens / timings.seconds["none"], abs=1e-3)
    assert (measured["samples_per_step"], measured["micro_batch"], measured["passes"]) == (16, 2, 3)


def probed(ways: dict | None) -> ProbeResult:
    """A cpu probe whose one trial (2 rows of the longest example) took 1 s, and the ways timed after it."""
    trial = ProbeTrial(micro_batch=2, fits=True, peak_bytes=1, seconds=1.0, step_seconds=1.0)
    return ProbeResult(recipe_path="r.yaml", meter="cpu", device="cpu", gpu=None, data="instructions",
                       budget_bytes=2**30, headroom=0.1, limit_bytes=2**30, cap=16, world_size=1, micro_batch_max=2,
                       peak_bytes=1, tensor_bytes=1, step_seconds=1.0, trials=[trial], line=None, seconds=1.0,
                       torch_version="-", ways=ways)


@pytest.mark.parametrize("way", ["packed", "sorted"])
def test_the_plans_cost_is_the_whole_steps_of_the_way_the_run_uses(way):
    """The cost line and `cost` of a plan whose way was timed after the probe: that way's optimizer step as measured
    (8 micro-steps of 2 at 1 s each by the probe's trial would say 8 s), and the line says so; a plan of another way,
    micro-batch or batch keeps the probe's trials."""
    recipe = parse_recipe({"batch": {"effective": 16}, "task": "language-modeling",
                           "model": {"builtin": "llama-7b", "kwargs": INSTRUCTIONS_LLAMA},
                           "data": {"format": "instructions", "max_length": 512, "available": False, "packing": way},
                           "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"total": {"steps": 3}}})
    plan = make_plan(recipe, 2, 1)
    timings = WayTimings({"none": 6.0, way: 3.0}, tokens=1500, chosen=way, steps=2, passes=3, per_rank=16,
                         micro_batch=2)
    cost = plan_costs(plan, probed(timings.to_json()))[plan.policy]
    assert cost is not None and cost.step_seconds == pytest.approx(1.5) and cost.total_seconds == pytest.approx(4.5)
    [line] = cost_lines(plan, probed(timings.to_json()))
    assert line.endswith(f"; timed as the run groups its windows ({way}: whole optimizer steps, the least of 3 "
                         "passes)")
    for other in (WayTimings({"none": 6.0}, 1500, "none", 2, 3, 16, 2), WayTimings({way: 3.0}, 1500, way, 2, 3, 8, 2),
                  WayTimings({way: 3.0}, 1500, way, 2, 3, 16, 4), None):
        result = probed(other.to_json() if other else None)
        assert plan_costs(plan, result)[plan.policy].step_seconds == pytest.approx(8.0)  # the probe's trial
        assert "timed as the run groups" not in cost_lines(plan, result)[0]


def test_the_ways_clock_is_the_processs_cpu_time_on_a_cpu_and_the_wall_clock_on_cuda():
    """On a CPU a wait (for a core, for a sleep) costs no CPU time, so it does not rank the ways; CUDA's kernels are
    not slowed by the host's load, and its steps are synchronised: the wall clock."""
    kind, tick = clock(torch.device("cpu"))
    start, wall = tick(), time.perf_counter()
    time.sleep(WAIT)
    assert kind == "cpu" and tick() - start < 0.2 * WAIT <= time.perf_counter() - wall
    assert clock(torch.device("cuda")) == ("wall", time.perf_counter)
