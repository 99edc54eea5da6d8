"""The sharding arithmetic (probe/sharding.py): pure functions, checked by their properties and by hand counts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reproduce.probe.sharding import (
    Blocks,
    StepMemory,
    gathered_bytes,
    shard,
    sharded_peak,
    smallest_world_size,
    unsharded_floor,
)

GiB = 2**30
sizes = st.integers(min_value=0, max_value=2**40)


@st.composite
def steps(draw) -> StepMemory:
    weights = draw(sizes)
    return StepMemory(
        weights=weights, buffers=draw(st.integers(0, weights)), gradients=draw(sizes), optimizer_state=draw(sizes),
        activations=draw(sizes), weight_copies=draw(sizes), step_temporaries=draw(sizes),
    )


blocks = st.builds(Blocks, root=st.integers(0, 2**34), blocks=st.lists(st.integers(0, 2**32), max_size=40).map(tuple))
compute = st.sampled_from([2, 4])
ranks = st.integers(min_value=1, max_value=4096)


@settings(max_examples=300, deadline=None)
@given(steps(), blocks, compute, ranks, ranks)
def test_more_ranks_never_hold_more(step, units, nbytes, a, b):
    low, high = sorted((a, b))
    assert sharded_peak(step, units, high, nbytes).peak <= sharded_peak(step, units, low, nbytes).peak


@settings(max_examples=300, deadline=None)
@given(steps(), blocks, compute, ranks)
def test_a_rank_holds_its_share_of_the_states_and_never_less_than_what_is_not_sharded(step, units, nbytes, world):
    peak = sharded_peak(step, units, world, nbytes)
    sharded = step.weights - step.buffers + step.gradients + step.optimizer_state
    share = peak.model_states - step.buffers
    assert share * world >= sharded > (share - 1) * world  # ceil(total / W): FSDP2's dim-0 chunks round up
    assert peak.peak >= unsharded_floor(step, units, nbytes)
    assert peak.peak >= peak.model_states + peak.step_temporaries
    assert peak.peak == max(peak.forward_backward, peak.optimizer_step)
    assert peak.to_json()["peak"] == peak.peak


@settings(max_examples=200, deadline=None)
@given(steps(), blocks, compute)
def test_with_very_many_ranks_only_what_is_not_sharded_remains(step, units, nbytes):
    many = 2**40
    peak = sharded_peak(step, units, many, nbytes)
    floor = unsharded_floor(step, units, nbytes)
    assert floor <= peak.peak <= floor + 4  # ceil(x / W) <= 1 for each sharded part


@settings(max_examples=200, deadline=None)
@given(steps(), blocks, compute, st.integers(0, 2**41))
def test_smallest_world_size_is_the_fewest_that_fit(step, units, nbytes, limit):
    found = smallest_world_size(step, units, limit, nbytes, most=4096)
    fits = lambda world: sharded_peak(step, units, world, nbytes).peak <= limit  # noqa: E731
    if found is None:
        assert not fits(4096)
    else:
        assert found >= 2 and fits(found)
        assert found == 2 or not fits(found - 1)


def test_gathered_blocks_by_hand():
    """The root (always gathered), two largest blocks in bf16, and the largest unit's gradients in bf16 + fp32."""
    units = Blocks(root=100, blocks=(10, 30, 20))
    assert gathered_bytes(units, compute_bytes=2) == (100 + 30 + 20) * 2 + 100 * (2 + 4)
    units = Blocks(root=5, blocks=(10, 30, 20))
    assert gathered_bytes(units, compute_bytes=2) == (5 + 30 + 20) * 2 + 30 * (2 + 4)
    assert gathered_bytes(Blocks(root=7), compute_bytes=4) == 7 * 4 + 7 * (4 + 4)  # no blocks: the model is one unit


def test_a_sharded_peak_by_hand():
    """LLaMA-7B-like numbers: fp32 AdamW states over 4 ranks, bf16 compute."""
    params = 6_738_415_616
    step = StepMemory(weights=4 * params, buffers=0, gradients=4 * params, optimizer_state=8 * params,
                      activations=4 * GiB, weight_copies=2 * params, step_temporaries=4 * params)
    units = Blocks(root=262_410_240, blocks=(202_383_360,) * 32)
    peak = sharded_peak(step, units, 4, compute_bytes=2)
    assert peak.model_states == shard(16 * params, 4) == 4 * params
    assert peak.gathered == (262_410_240 + 2 * 202_383_360) * 2 + 262_410_240 * 6
    assert peak.activations == 4 * GiB and peak.step_temporaries == params
    assert peak.peak == peak.forward_backward == 4 * params + peak.gathered + 4 * GiB


def test_bad_arguments():
    step = StepMemory(1, 0, 1, 1, 1, 0, 1)
    with pytest.raises(ValueError):
        sharded_peak(step, Blocks(root=1), 0, 2)
    with pytest.raises(ValueError):
        Blocks(root=-1)
    assert smallest_world_size(step, Blocks(root=1), limit_bytes=0, compute_bytes=2) is None
