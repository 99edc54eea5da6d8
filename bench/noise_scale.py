"""The gradient noise scale of the built-in recipes over a run, beside their effective batch, and what measuring it
costs in time and memory.

    python bench/noise_scale.py [--pairs 40] [--run-steps-gpt 300] [--skip-runs] [--definition]

1. The run: `reproduce run`'s `train()` over each built-in recipe (papers/digits-mlp.yaml, 32 x 8, and
   papers/pysource-gpt.yaml, 16 x 4), its noise scale every tenth of the run, the summary's value over the last
   tenth against the effective batch (the sentence the run prints), and the spread of the raw per-window
   estimates over the last tenth (what the EMA has to smooth).
2. Time: optimizer steps of the run's own step machinery (`step.optimizer_step` on a model built by `setup.build`),
   alternately with and without the measurement, `--pairs` pairs: the median time per step of each, and the median
   of the pairs' relative differences with their quartiles. Beside it, the time spent inside the measurement's own
   code, timed around each of its calls (its parameter hooks run inside the backward passes; the timing's own cost
   taken off), median per step: an upper bound, as the first small operation after a large one pays for the
   cache the large one left, which the backward's next operation would pay otherwise. On a CPU with one torch
   thread all of it runs on this thread, so each is given as this thread's CPU time (`time.thread_time`: what
   other jobs on a shared machine take is not counted) and as wall time. Goal: under 1% of a step on the built-in
   GPT.
3. Memory: the peak of one optimizer step with and without the measurement (after a warm-up step), every tensor
   storage counted by the CPU tracker (`reproduce.probe.tracker.MemoryTracker`, 512 B blocks). Goal: none extra.
4. `--definition`: what a language model's noise scale in tokens means. The tests' small GPT on ~1,800 windows of
   32 tokens of Python source, weights fixed: the run's estimate against tr(Sigma) / |G|^2 from exact gradients
   (`torch.func`) of every sequence (the items the run draws, their mean token loss; x 32 to count tokens) and of
   every token alone (as if tokens were drawn one by one).

One torch thread, so timings repeat on a shared machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from reproduce.data import build_data  # noqa: E402
from reproduce.data.batches import LazyMicroBatch  # noqa: E402
from reproduce.observe import noise as noise_module  # noqa: E402
from reproduce.plan.planner import make_plan  # noqa: E402
from reproduce.plan.recipe import load_recipe, parse_recipe  # noqa: E402
from reproduce.plan.units import format_size  # noqa: E402
from reproduce.probe.tracker import MemoryTracker  # noqa: E402
from reproduce.train.setup import build  # noqa: E402
from reproduce.train.step import optimizer_step  # noqa: E402
from reproduce.train.trainer import RunRequest, read_metrics, train  # noqa: E402
from reproduce.train.windows import window  # noqa: E402

CASES = {"mlp": ("papers/digits-mlp.yaml", 32), "gpt": ("papers/pysource-gpt.yaml", 16)}  # m: the recipes' own


class TimedNoiseScale(noise_module.NoiseScale):
    """The run's measurement, with the time spent in each of its calls added up (hooks included): this thread's
    CPU seconds and wall seconds, less what the timing itself costs (`calibrate`)."""

    overhead = (0.0, 0.0)  # (cpu, wall) seconds the timing adds to one call

    def __init__(self, setup):
        self.cpu = self.wall = 0.0
        super().__init__(setup)

    def _timed(name):  # noqa: N805 (a decorator factory inside the class body)
        def method(self, *args, **kwargs):
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                return getattr(noise_module.NoiseScale, name)(self, *args, **kwargs)
            finally:
                self.cpu += time.thread_time() - cpu - self.overhead[0]
                self.wall += time.perf_counter() - wall - self.overhead[1]
        return method

    @classmethod
    def calibrate(cls, calls: int = 20000) -> None:
        """The timing's own cost per call: the same wrapper around a call that does nothing."""
        probe = cls.__new__(cls)
        probe.cpu = probe.wall = 0.0
        probe.sink = None
        cpu, wall = time.thread_time(), time.perf_counter()
        for _ in range(calls):
            probe._gradient(None)  # returns at once: no window is running
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        plain = noise_module.NoiseScale._gradient
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        for _ in range(calls):
            plain(probe, None)
        cpu -= time.thread_time() - started_cpu
        wall -= time.perf_counter() - started_wall
        cls.overhead = (cpu / calls, wall / calls)

    start_window = _timed("start_window")
    _gradient = _timed("_gradient")
    after_backward = _timed("after_backward")
    end_window = _timed("end_window")


def run_over_recipe(name: str, path: str, micro: int, steps: int | None) -> None:
    recipe = load_recipe(ROOT / path)
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(data.train))
    with tempfile.TemporaryDirectory() as folder:
        summary = train(plan, RunRequest(Path(folder) / "run", device="cpu", max_steps=steps), data=data)
        records = [r for r in read_metrics(Path(folder) / "run" / "metrics.jsonl") if "loss" in r]
    total = summary["steps"]
    noise = summary["noise_scale"]
    print(f"\n{name} ({path}): {plan.arithmetic}, {total} steps in {summary['seconds']:.0f} s")
    print("| step | loss | noise_scale (EMA) |")
    print("|---:|---:|---:|")
    for step in sorted({max(1, round(total * k / 10)) for k in range(11)}):
        record = records[step - 1]
        value = record.get("noise_scale")
        print(f"| {step} | {record['loss']:.4f} | {'-' if value is None else f'{value:.0f}'} |")
    tenth = [r for r in records if r["step"] >= noise["last_tenth_steps"][0] and "noise_trace" in r]
    spread = {key: statistics.stdev(r[key] for r in tenth) / abs(statistics.fmean(r[key] for r in tenth))
              for key in ("noise_grad_sq", "noise_trace")} if len(tenth) > 2 else {}
    last = noise["last_tenth"]
    print(f"effective batch {noise['effective_batch']:.0f} {noise['unit']}, B_small {noise['small_batch']:.0f}; "
          f"noise scale over the last tenth {'-' if last is None else f'{last:.0f}'}, at the end "
          f"{'-' if noise['final'] is None else format(noise['final'], '.0f')}")
    if spread:
        print("raw per-window estimates over the last tenth, standard deviation / |mean|: "
              f"|G|^2 {spread['noise_grad_sq']:.0%}, tr(Sigma) {spread['noise_trace']:.0%}")
    print(f"the run's line: noise scale: {noise['sentence']}")


def cost(name: str, path: str, micro: int, pairs: int) -> None:
    recipe = load_recipe(ROOT / path)
    data = build_data(recipe)
    train_set = data.train
    plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(train_set))
    setup = build(plan, torch.device("cpu"), data=data)
    step = 0

    def one_step(measure: bool) -> tuple[float, float, float, float]:
        """(cpu, wall) seconds of one optimizer step, and of the measurement inside it."""
        nonlocal step
        indices, _ = window(plan, len(train_set), step, recipe.seed)
        batches = [LazyMicroBatch(train_set, i, setup.device, setup.dtype) for i in indices]
        monitor = TimedNoiseScale(setup) if measure else None  # its hooks exist only for this step
        cpu, wall = time.thread_time(), time.perf_counter()
        optimizer_step(setup, batches, monitor)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        step += 1
        if monitor is None:
            return cpu, wall, 0.0, 0.0
        monitor.close()
        return cpu, wall, monitor.cpu, monitor.wall

    one_step(False), one_step(True)  # warm-up
    rows = [(one_step(True), one_step(False)) for _ in range(pairs)]  # with, then without: one pair
    for column, label in ((0, "cpu"), (1, "wall")):
        on = statistics.median(pair[0][column] for pair in rows)
        off = statistics.median(pair[1][column] for pair in rows)
        differences = sorted((pair[0][column] - pair[1][column]) / pair[1][column] for pair in rows)
        quartiles = statistics.quantiles(differences, n=4)
        own = statistics.median(pair[0][column + 2] for pair in rows)
        print(f"| {name} | {plan.arithmetic} | {label} | {off * 1e3:.2f} ms | {on * 1e3:.2f} ms | "
              f"{statistics.median(differences):+.2%} ({quartiles[0]:+.1%} .. {quartiles[2]:+.1%}) | "
              f"{own * 1e3:.3f} ms | {own / off:.2%} |", flush=True)


def state_tensors(setup) -> list[torch.Tensor]:
    state = [t for s in setup.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [*setup.unwrapped_model.parameters(), *setup.unwrapped_model.buffers(), *state]


def memory(name: str, path: str, micro: int) -> None:
    recipe = load_recipe(ROOT / path)
    data = build_data(recipe)
    train_set = data.train
    plan = make_plan(recipe, micro_batch_max=micro, dataset_size=len(train_set))
    setup = build(plan, torch.device("cpu"), data=data)
    indices, _ = window(plan, len(train_set), 0, recipe.seed)
    batches = lambda: [LazyMicroBatch(train_set, i, setup.device, setup.dtype) for i in indices]  # noqa: E731
    optimizer_step(setup, batches())  # warm-up: the optimizer state exists

    def peak(monitor) -> int:
        tracker = MemoryTracker()
        with tracker:
            tracker.charge(state_tensors(setup))
            tracker.reset_peak()
            optimizer_step(setup, batches(), monitor)
        return tracker.peak

    without = peak(None)
    monitor = noise_module.NoiseScale(setup)
    with_noise = peak(monitor)
    monitor.close()
    print(f"| {name} | {plan.arithmetic} | {format_size(without)} | {format_size(with_noise)} | "
          f"{with_noise - without:+d} B |", flush=True)


def definition(steps: int = 100) -> None:
    from torch.func import functional_call, grad, jacrev, vmap

    from reproduce.data.batches import fetch

    length = 32
    recipe = parse_recipe({
        "batch": {"effective": 64 * length, "unit": "tokens", "sequence_length": length},
        "task": "language-modeling", "model": {"builtin": "gpt", "kwargs": {"layers": 1, "heads": 2, "dim": 32}},
        "data": {"builtin": "pysource", "kwargs": {"max_bytes": 60_000, "validation_every": 3}, "shuffle": True},
        "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 1000}},
    })
    data = build_data(recipe)
    train_set = data.train
    plan = make_plan(recipe, micro_batch_max=8, dataset_size=len(train_set))
    setup = build(plan, torch.device("cpu"), data=data)
    for group in setup.optimizer.param_groups:  # the learning rate at 0: the weights stay where they are
        group["lr"] = 0.0
    setup.scheduler.base_lrs = [0.0] * len(setup.scheduler.base_lrs)
    monitor = noise_module.NoiseScale(setup)
    records = []
    for step in range(steps):
        indices, _ = window(plan, len(train_set), step, recipe.seed)
        batches = [LazyMicroBatch(train_set, i, setup.device, setup.dtype) for i in indices]
        records.append(optimizer_step(setup, batches, monitor).noise)
    monitor.close()
    model = setup.unwrapped_model
    params = {name: p.detach() for name, p in model.named_parameters()}

    def token_losses(p, tokens, target):
        return F.cross_entropy(functional_call(model, p, (tokens.unsqueeze(0),))[0], target, reduction="none")

    per_sequence = vmap(grad(lambda p, x, y: token_losses(p, x, y).mean()), in_dims=(None, 0, 0))
    per_token = vmap(jacrev(token_losses), in_dims=(None, 0, 0))
    total, sequence_squares, token_squares, n = 0.0, 0.0, 0.0, len(train_set)
    for start in range(0, n, 64):
        inputs, targets = fetch(train_set, torch.arange(start, min(start + 64, n)))
        flat = torch.cat([g.flatten(1) for g in per_sequence(params, inputs, targets).values()], 1).double()
        total, sequence_squares = total + flat.sum(0), sequence_squares + float((flat**2).sum())
        tokens = torch.cat([g.flatten(2) for g in per_token(params, inputs, targets).values()], 2).double()
        token_squares += float((tokens**2).sum())
    mean = total / n
    grad_sq = float(mean @ mean)
    by_sequence = length * (sequence_squares - n * grad_sq) / (n - 1) / grad_sq
    by_token = (token_squares - n * length * grad_sq) / (n * length - 1) / grad_sq
    measured = [r for r in records if "noise_trace" in r]
    ratio = statistics.fmean(r["noise_trace"] for r in measured) / statistics.fmean(r["noise_grad_sq"]
                                                                                    for r in measured)
    print(f"\n## What a noise scale in tokens means: {n} sequences of {length} tokens, weights fixed, {steps} windows "
          f"of {plan.arithmetic}")
    print(f"exact, per sequence drawn (x {length}): {by_sequence:.1f} tokens; exact, per token drawn alone: "
          f"{by_token:.1f} tokens")
    print(f"the run's estimate: EMA at the end {records[-1]['noise_scale']:.1f}, ratio of the mean estimates over "
          f"the {len(measured)} windows {ratio:.1f} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=40, help="optimizer steps with and without, alternating")
    parser.add_argument("--run-steps-gpt", type=int, default=None, help="steps of the GPT run (default: all 300)")
    parser.add_argument("--skip-runs", action="store_true", help="only the cost")
    parser.add_argument("--definition", action="store_true", help="also the exact definition in tokens (slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as `reproduce run` does on a CPU
    TimedNoiseScale.calibrate()
    print(f"torch {torch.__version__}, CPU, one thread; EMA factor {noise_module.EMA_FACTOR}; the timing's own cost, "
          f"{TimedNoiseScale.overhead[0] * 1e6:.2f} us CPU a call, taken off")
    print(f"\n## Time: {args.pairs} pairs of optimizer steps with and without, alternating, median per step")
    print("| recipe | m x N x W | time | without | with | difference (quartiles) | inside the measurement | "
          "of a step |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for name, (path, micro) in CASES.items():
        cost(name, path, micro, args.pairs)
    print("\n## Memory: peak of one optimizer step (tensor storage, 512 B blocks)")
    print("| recipe | m x N x W | without | with | difference |")
    print("|---|---|---:|---:|---:|")
    for name, (path, micro) in CASES.items():
        memory(name, path, micro)
    if not args.skip_runs:
        print("\n## The noise scale over each recipe's run")
        for name, (path, micro) in CASES.items():
            run_over_recipe(name, path, micro, args.run_steps_gpt if name == "gpt" else None)
    if args.definition:
        definition()


if __name__ == "__main__":
    main()
