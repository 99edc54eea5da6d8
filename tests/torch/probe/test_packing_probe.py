"""The probe in tokens (probe/tokens.py): with `sorted` the token budget T is searched between the sample probe's
m x L (fits) and (m + 1) x L (does not) in steps of L / 8 by the probe's own search, on real trials of a small LLaMA
with LoRA (the cpu meter) over the sample instructions; `packed` trials attend through the block mask the run uses
(cpu and estimate meters); the plan takes T and says how it was found."""

from __future__ import annotations

import random

import pytest
import torch

from helpers import CPU_12MIB, cli, cli_json, instructions_recipe
from reproduce.data.packing import Grouping, group
from reproduce.plan.recipe import parse_recipe
from reproduce.probe.meters import CpuMeter, EstimateMeter
from reproduce.probe.runner import ProbeOptions, run_probe
from reproduce.probe.tokens import TOKEN_STEPS
from reproduce.probe.workload import Workload
from reproduce.session import plan_and_probe


def test_sorted_searches_its_token_budget_between_m_and_m_plus_one_rows(sample_data, isolated):
    """data.packing sorted: T is the largest m x L + x x step measured to fit, and the next step up was measured
    not to (or is (m + 1) x L, which the sample probe measured not to fit)."""
    recipe = parse_recipe(instructions_recipe(sample_data, packing="sorted"))
    result = run_probe(recipe, options=CPU_12MIB)
    rows, longest, step, budget = result.micro_batch_max, result.longest, result.token_step, result.token_budget
    assert rows is not None and not result.capped and step == -(-longest // TOKEN_STEPS)
    assert rows * longest <= budget < (rows + 1) * longest and (budget - rows * longest) % step == 0
    assert budget > rows * longest  # finer than rows of the longest example here
    trials = {t.micro_batch: t for t in result.token_trials}
    assert trials[budget].fits and trials[budget].peak_bytes <= result.limit_bytes
    above = budget + step
    assert (above in trials and not trials[above].fits) or above >= (rows + 1) * longest
    assert all(t.fits == (t.micro_batch <= budget) for t in result.token_trials)  # (peaks grow with T)
    assert any(t.micro_batch == rows + 1 and not t.fits for t in result.trials)

    planned = plan_and_probe(recipe, "recipe.yaml", None, 1, probe=CPU_12MIB).plan  # (the cached probe)
    assert (planned.recipe.data.packing, planned.recipe.data.token_budget) == ("sorted", budget)


def test_a_given_micro_batch_max_still_searches_the_token_budget_for_the_memory(sample_data, isolated):
    """`micro_batch_max` with `memory`: the micro-batch is the one given, `sorted`'s T is still searched for that
    memory (the probe's rows of the longest example bracket it), and the line says what was and was not done; a
    way with no T to search (packed, the default for LLaMA) or a T given probe nothing, as before."""
    recipe = parse_recipe(instructions_recipe(sample_data, packing="sorted"))
    notes: list[str] = []
    planned = plan_and_probe(recipe, "recipe.yaml", 4, 1, probe=CPU_12MIB, on_note=notes.append)
    budget = run_probe(recipe, options=CPU_12MIB).token_budget  # (the cached probe)
    assert budget is not None and planned.probe is not None and planned.probe.token_budget == budget
    assert (planned.plan.micro_batch_max, planned.plan.micro_batch) == (4, 4)
    assert (planned.plan.recipe.data.packing, planned.plan.recipe.data.token_budget) == ("sorted", budget)
    assert notes == [f"`memory` 12MiB: `micro_batch_max` was given, so the micro-batch was not probed (nor the ways "
                     f"to group the data timed); the token budget, searched for it: {budget:,} tokens per micro-batch "
                     "(sorted)"]
    for data in ({}, {"packing": "sorted", "token_budget": 1000}):
        notes.clear()
        planned = plan_and_probe(parse_recipe(instructions_recipe(sample_data, **data)), "recipe.yaml", 4, 1,
                                 probe=CPU_12MIB, on_note=notes.append)
        assert planned.probe is None and planned.plan.recipe.data.token_budget == data.get("token_budget")
        assert len(notes) == 1 and notes[0].startswith("`memory` 12MiB: not used: `micro_batch_max` was given")


def test_a_sorted_probe_whose_whole_batch_fits_searches_no_token_budget(sample_data, isolated):
    """16 rows of the longest example fit in 1 GiB (the estimate meter): the whole batch is one micro-batch, there
    is no T to search, and the plan takes the micro-batch x the longest example (the probe raised AttributeError on
    the search it skipped before), with or without a micro-batch maximum given."""
    recipe = parse_recipe(instructions_recipe(sample_data, packing="sorted"))
    probe = ProbeOptions(memory="1GiB", meter="estimate")
    planned = plan_and_probe(recipe, "recipe.yaml", None, 1, probe=probe)
    assert planned.probe is not None and planned.probe.capped and planned.probe.token_budget is None
    assert (planned.plan.micro_batch, planned.plan.recipe.data.token_budget) == (16, None)
    notes: list[str] = []
    planned = plan_and_probe(recipe, "recipe.yaml", 4, 1, probe=probe, on_note=notes.append)
    assert (planned.plan.micro_batch, planned.plan.recipe.data.token_budget) == (4, None)
    assert notes[0].endswith("the token budget, not searched: the whole batch per process fits in rows of the "
                             "longest example (T: the micro-batch x the longest example)")


def test_probe_and_plan_print_the_token_budget_and_how_it_was_found(sample_data, isolated, tmp_path, capsys):
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(instructions_recipe(sample_data, packing="sorted")))
    options = ("--memory", "12MiB", "--meter", "cpu")
    probed = cli_json(capsys, "probe", path, *options)
    budget = probed["token_budget"]
    code, out, err = cli(capsys, "probe", path, *options)  # from the cache
    assert code == 0, err
    said = f"token budget: {budget:,} tokens per micro-batch (sorted), measured: {probed['micro_batch_max']} rows of"
    assert said in " ".join(out.split())
    summary = cli_json(capsys, "plan", path, *options)
    assert summary["packing"]["token_budget"] == budget and summary["packing"]["given"]
    code, out, err = cli(capsys, "plan", path, *options)
    assert code == 0 and f"token budget {budget:,} tokens per micro-batch (sorted), measured:" in " ".join(out.split())
    code, out, err = cli(capsys, "plan", path, *options, "--token-budget", "600", "--packing", "sorted")
    assert code == 0 and "token budget 600 (data.token_budget, --token-budget)" in " ".join(out.split())


@pytest.mark.parametrize("meter", [CpuMeter, EstimateMeter])
def test_packed_trials_run_the_varlen_attention_the_run_uses(sample_data, meter, one_thread, monkeypatch):
    """A `packed` trial is the run's micro-batch of m x L tokens: ONE row of m samples of L, position ids restarting
    at each, through the varlen attention build_model selects (models/varlen.py), on a real step (cpu) and on fake
    tensors (estimate: the position ids stay real). The same row through transformers' dense block mask (the model
    left on sdpa) costs more: the (T x T) mask and the masked pairs the varlen attention never computes."""
    workload = Workload(parse_recipe(instructions_recipe(sample_data, packing="packed")))
    inputs, targets = workload.batch(2)
    longest = len(workload.longest()[0])
    positions = inputs["position_ids"]
    assert positions.shape == inputs["input_ids"].shape == targets.shape == (1, 2 * longest)
    assert positions[0].tolist() == list(range(longest)) * 2  # two samples in one row
    varlen = meter(workload, 1 << 30, 0.1).measure(2).peak_bytes
    from reproduce.models import varlen as module

    monkeypatch.setattr(module, "use_varlen", lambda model: False)  # the model left on sdpa: the dense block mask
    dense = meter(Workload(parse_recipe(instructions_recipe(sample_data, packing="packed"))), 1 << 30, 0.1).measure(2)
    assert dense.peak_bytes > varlen


def test_packed_finds_its_budget_in_rows_with_no_token_search(sample_data, isolated):
    result = run_probe(parse_recipe(instructions_recipe(sample_data, packing="packed")), options=CPU_12MIB)
    assert result.micro_batch_max is not None and result.token_budget is None and not result.token_trials


@pytest.mark.parametrize("seed", range(8))
def test_every_sorted_micro_batch_of_t_tokens_is_bounded_by_the_measured_shape(seed):
    """The argument of probe/tokens.py on random lengths and budgets: a sorted micro-batch within T computes at most
    T tokens, and has either at most m rows (of at most L: the m rows of L measured) or rows no longer than the
    measured shape's T // (m + 1)."""
    generator = random.Random(seed)
    lengths = torch.tensor([generator.randint(1, 300) for _ in range(200)])
    longest = int(lengths.max())
    rows = generator.randint(1, 6)
    budget = rows * longest + generator.randint(1, longest - 1)
    grouping = Grouping("sorted", budget, longest, lengths, micro_batch=rows)
    for micro_batch in group(torch.randperm(200, generator=torch.Generator().manual_seed(seed)), grouping, budget):
        count, row = len(micro_batch), int(lengths[micro_batch].max())
        assert count * row <= budget
        assert count <= rows or row <= budget // (rows + 1)


def test_each_way_is_timed_on_the_same_windows_and_the_fastest_chosen(sample_data, one_thread):
    """throughput/ways.py: every way runs whole steps of the same samples (the same target tokens), the fastest is
    chosen, and the line says each way's rate."""
    from reproduce.throughput.ways import time_ways

    recipe = parse_recipe(instructions_recipe(sample_data))
    data = Workload(recipe).data
    timings = time_ways(recipe, ["none", "sorted", "packed"], 2, 16, data, torch.device("cpu"), steps=1)
    assert set(timings.seconds) == {"none", "sorted", "packed"} and all(s > 0 for s in timings.seconds.values())
    assert timings.chosen == min(timings.seconds, key=timings.seconds.get)
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))
    assert timings.tokens == int(data.train.target_counts(order[16:32]).sum())  # the second window (the first warms)
    assert timings.line().startswith(f"packing: {timings.chosen}, the fastest exact way measured here")


@pytest.mark.slow  # the probe, then three ways timed (about 40 s here); the faster test of the timing itself:
# test_each_way_is_timed_on_the_same_windows_and_the_fastest_chosen
def test_the_default_way_is_the_fastest_timed_here_when_the_probe_ran(sample_data, isolated, one_thread):
    """A recipe that leaves data.packing to its default, probed on this device with its data: every exact way (none,
    sorted, packed for LLaMA) runs whole steps of the same windows, and the plan takes the fastest per target token,
    said in one line; a way the recipe gives, or a plan without a probe (--micro-batch-max), is not timed."""
    import re

    recipe = parse_recipe(instructions_recipe(sample_data))
    data = Workload(recipe).data
    notes: list[str] = []
    planned = plan_and_probe(recipe, "recipe.yaml", None, 1, probe=CPU_12MIB, data=data, on_note=notes.append)
    timed = [line for line in notes if line.startswith("packing: ")]
    assert len(timed) == 1, notes
    rates = {way: float(rate.replace(",", "")) for way, rate in re.findall(r"(none|sorted|packed) ([\d,]+)", timed[0])}
    assert set(rates) == {"none", "sorted", "packed"}
    chosen = max(rates, key=lambda way: rates[way])
    assert timed[0].startswith(f"packing: {chosen}, the fastest exact way measured here")
    assert planned.plan.recipe.data.packing == chosen
    from reproduce.throughput.cost import cost_lines  # the plan's cost: the chosen way's steps as timed

    assert planned.probe.ways["chosen"] == chosen and set(planned.probe.ways["ways"]) == set(rates)
    assert cost_lines(planned.plan, planned.probe)[0].endswith(f"({chosen}: whole optimizer steps, the least of 3 "
                                                               "passes)")
    for given, micro_batch_max in (({"packing": "sorted"}, None), ({}, 2)):
        notes.clear()
        recipe = parse_recipe(instructions_recipe(sample_data, **given))
        planned = plan_and_probe(recipe, "recipe.yaml", micro_batch_max, 1, probe=CPU_12MIB, data=data,
                                 on_note=notes.append)
        assert not any(line.startswith("packing: ") for line in notes)
        assert planned.plan.recipe.data.packing == ("sorted" if given else "packed")
