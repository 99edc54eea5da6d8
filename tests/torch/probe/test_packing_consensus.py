"""Under several processes every rank probes its own device and all take the smallest result: with `sorted`, the
token budget too (session.agreed_budget), so every rank groups its windows alike and none runs out of memory; on
real trials of a small LLaMA with LoRA (the cpu meter) over the sample instructions."""

from __future__ import annotations

from helpers import CPU_12MIB, instructions_recipe
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.session import NO_BUDGET, probe_consensus


def test_the_ranks_agree_on_the_smallest_token_budget(sample_data, isolated):
    """This rank measured T between 2 and 3 rows of the longest example; another rank's smaller T is taken by every
    rank, a rank that measured none (NO_BUDGET) takes the others', and a recipe's own T is not agreed on."""
    recipe = parse_recipe(instructions_recipe(sample_data, packing="sorted"))
    for other in (lambda own: own - 57, lambda own: own):  # a rank with less memory; one with the same
        seen: list[int] = []

        def all_min(value: int, seen: list[int] = seen, other=other) -> int:
            seen.append(value)
            return value if len(seen) == 1 else min(value, other(value))

        agreed, maximum = probe_consensus(recipe, "r.yaml", 2, "exact", None, all_min, probe=CPU_12MIB)
        maximum_seen, own = seen
        assert maximum == maximum_seen == 2 and 2 * 457 <= own < 3 * 457  # (the longest example: 457 tokens)
        assert agreed.data.packing == "sorted" and agreed.data.token_budget == other(own)
        assert make_plan(agreed, maximum, 2).recipe.data.token_budget == other(own)
    seen = []
    agreed, _ = probe_consensus(recipe, "r.yaml", 2, "exact", None, lambda value: seen.append(value) or value,
                                probe=CPU_12MIB)
    assert seen[1:] == [agreed.data.token_budget]
    nobody = probe_consensus(recipe, "r.yaml", 2, "exact", None, lambda value: NO_BUDGET if value > 2 else value,
                             probe=CPU_12MIB)[0]
    assert nobody.data.token_budget is None  # (no rank measured one: T = m x the longest example)
    given = parse_recipe(instructions_recipe(sample_data, packing="sorted", token_budget=1000))
    seen = []
    agreed, _ = probe_consensus(given, "r.yaml", 2, "exact", None, lambda value: seen.append(value) or value,
                                probe=CPU_12MIB)
    assert len(seen) == 1 and agreed.data.token_budget == 1000


def test_with_a_given_micro_batch_max_the_ranks_agree_on_the_token_budget_only(sample_data, isolated):
    """`micro_batch_max` given with `memory`: each rank searches T for it and all take the smallest (one collective),
    and the maximum stays the one given."""
    recipe = parse_recipe(instructions_recipe(sample_data, packing="sorted"))
    seen: list[int] = []

    def all_min(value: int) -> int:  # another rank measured 57 tokens less
        seen.append(value)
        return value - 57

    agreed, maximum = probe_consensus(recipe, "r.yaml", 2, "exact", None, all_min, micro_batch_max=4, probe=CPU_12MIB)
    (own,) = seen
    assert maximum == 4 and 2 * 457 <= own < 3 * 457
    assert agreed.data.packing == "sorted" and agreed.data.token_budget == own - 57
