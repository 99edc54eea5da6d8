"""What one rank holds when parameters, gradients and optimizer state are sharded (FSDP). No torch.

The estimate meter measures one unsharded training step on fake tensors, split by the tracker into
`StepMemory`: the model states (weights, gradients, optimizer state) and what the step adds on top
(activations during forward and backward, temporaries of the optimizer step). Under FSDP full_shard
(ZeRO-3) over W ranks, as `torch.distributed.fsdp.fully_shard` does it per block, each rank holds:

- its shard of the model states: parameters (fp32 master weights), gradients (reduced in fp32) and
  optimizer state, divided over W (FSDP2 splits each parameter on dim 0 with `torch.chunk`, so a
  shard is at most ceil(size / W)); buffers are not sharded;
- what it gathers at a time (`gathered_bytes`): the root's parameters (the embeddings, final norm and
  head outside every block: the root keeps them unsharded from forward to backward), and two blocks'
  parameters in the compute dtype (FSDP2's MixedPrecisionPolicy all-gathers bf16/fp16 copies; the
  current block and the one prefetched, "two all-gather output tensors alive at once", PyTorch PR
  128884), plus one block's unsharded gradients in the compute dtype and the reduce-scatter input in
  the reduction dtype (fp32);
- the activations of its own micro-batch, as the unsharded step measured them (autocast's copies of
  the weights left out: under FSDP the gathered block is already in the compute dtype);
- in the optimizer step, its shard of the step's temporaries (the foreach optimizer works on the shards).

The peak is the larger of forward/backward and the optimizer step. `smallest_world_size` finds the
fewest ranks whose peak fits a limit. Everything here is arithmetic on measured bytes; the tests check its
properties (never more per rank with more ranks, never below what cannot be sharded).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PREFETCHED_BLOCKS = 2  # FSDP2: the block computing and the next one, all-gathered ahead


@dataclass(frozen=True)
class StepMemory:
    """One unsharded training step, measured (bytes of tensor storage)."""

    weights: int  # parameters and buffers as stored
    buffers: int  # of which buffers (FSDP does not shard them)
    gradients: int
    optimizer_state: int
    activations: int  # the most forward/backward hold beyond the model states (inputs, temporaries included)
    weight_copies: int  # the most autocast's compute-dtype copies of the weights hold, beside `activations`
    step_temporaries: int  # the most clipping and the optimizer step allocate beyond the model states

    @property
    def model_states(self) -> int:
        return self.weights + self.gradients + self.optimizer_state

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Blocks:
    """Parameter counts (elements) of the units FSDP wraps: one per block / residual stage, and the root."""

    root: int  # parameters in no block (embeddings, final norm, head), gathered for the whole step
    blocks: tuple[int, ...] = ()

    def __post_init__(self):
        if self.root < 0 or any(b < 0 for b in self.blocks):
            raise ValueError("parameter counts must be >= 0")


@dataclass(frozen=True)
class ShardedPeak:
    """One rank's peak under FSDP over `world_size` ranks, and what it is made of."""

    world_size: int
    model_states: int  # this rank's shard of weights, gradients and optimizer state, plus the buffers
    gathered: int  # unsharded parameters and gradients alive at once
    activations: int
    step_temporaries: int  # this rank's shard of the optimizer step's temporaries

    @property
    def forward_backward(self) -> int:
        return self.model_states + self.gathered + self.activations

    @property
    def optimizer_step(self) -> int:
        return self.model_states + self.step_temporaries

    @property
    def peak(self) -> int:
        return max(self.forward_backward, self.optimizer_step)

    def to_json(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def gathered_bytes(blocks: Blocks, compute_bytes: int, reduce_bytes: int = 4) -> int:
    """Unsharded parameters and gradients one rank holds at a time (see the module's notes)."""
    largest = sorted(blocks.blocks, reverse=True)[:PREFETCHED_BLOCKS]
    parameters = (blocks.root + sum(largest)) * compute_bytes
    reduced = max([blocks.root, *largest]) * (compute_bytes + reduce_bytes)  # one unit's gradients at a time
    return parameters + reduced


def sharded_peak(step: StepMemory, blocks: Blocks, world_size: int, compute_bytes: int,
                 reduce_bytes: int = 4) -> ShardedPeak:
    """One rank's peak with the model states of `step` sharded over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    sharded = step.weights - step.buffers + step.gradients + step.optimizer_state
    return ShardedPeak(
        world_size=world_size,
        model_states=shard(sharded, world_size) + step.buffers,
        gathered=gathered_bytes(blocks, compute_bytes, reduce_bytes),
        activations=step.activations,
        step_temporaries=shard(step.step_temporaries, world_size),
    )


def smallest_world_size(step: StepMemory, blocks: Blocks, limit_bytes: int, compute_bytes: int,
                        reduce_bytes: int = 4, most: int = 1 << 16) -> int | None:
    """The fewest ranks (>= 2) whose sharded peak is at most `limit_bytes`; None when no number of ranks does.

    The peak never grows with the number of ranks, so the answer is found by bisection; past `most` ranks
    (or when what is never sharded is already over the limit) there is none.
    """
    def fits(world_size: int) -> bool:
        return sharded_peak(step, blocks, world_size, compute_bytes, reduce_bytes).peak <= limit_bytes

    if not fits(most):
        return None
    low, high = 1, most  # fits(high); low does not fit (or is 1, which is not sharding)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return max(high, 2)


def unsharded_floor(step: StepMemory, blocks: Blocks, compute_bytes: int, reduce_bytes: int = 4) -> int:
    """What no number of ranks shards away: the buffers, the gathered units and the activations."""
    return step.buffers + gathered_bytes(blocks, compute_bytes, reduce_bytes) + step.activations
