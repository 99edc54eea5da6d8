"""What one rank holds when parameters, gradients and optimizer state are sharded (FSDP). No torch.

From one unsharded step's `StepMemory`, under FSDP2 full_shard (ZeRO-3) over W ranks, per block, with a
`MixedPrecisionPolicy` (parameters gathered in the compute dtype, gradients reduced in fp32), each rank holds: its
shard of the fp32 master weights and optimizer state, at most ceil(size / W) (`torch.chunk` on dim 0; buffers
whole); the gradients, sharded once reduce-scattered, but within an accumulation window under `no_sync` (as `run`
does) every gradient unsharded in fp32 (`FSDPParam.to_accumulated_grad_if_needed`) until the last backward
(`unsharded_window=True`); the root's parameters (embeddings, final norm, head: forward to backward) and two
blocks' in the compute dtype (current and prefetched, PyTorch PR 128884), plus one unit's gradients and its
reduce-scatter input; its micro-batch's activations as measured (less autocast's weight copies: gathered blocks are
already in the compute dtype); and in the optimizer step its shard of the temporaries (foreach on the shards).
The peak is the larger of forward/backward and the optimizer step; `smallest_world_size` finds the fewest ranks
that fit a limit. `bench/fsdp_check.py` compares it with what FSDP2 allocates on one rank.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PREFETCHED_BLOCKS = 2  # FSDP2: the block computing and the next one, all-gathered ahead
REDUCE_BYTES = 4  # the gradients' reduction dtype, fp32 (MixedPrecisionPolicy's reduce_dtype)


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
    # What coexisted (None: assume the most of each did): the gradients already there when the activations were
    # at their most (those of the window's earlier micro-batches), the activations left when the gradients were.
    gradients_at_activation_peak: int | None = None
    activations_at_gradient_peak: int | None = None

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
    trainable: int | None = None  # parameters that get gradients (all of them when None)

    def __post_init__(self):
        if self.root < 0 or any(b < 0 for b in self.blocks) or (self.trainable or 0) < 0:
            raise ValueError("parameter counts must be >= 0")

    @classmethod
    def of(cls, parts: dict) -> Blocks:
        kept = parts["blocks"]
        return cls(root=kept["root"], blocks=tuple(kept["sizes"]), trainable=kept.get("trainable"))

    @property
    def parameters(self) -> int:
        return self.root + sum(self.blocks)

    @property
    def with_gradients(self) -> int:
        return self.parameters if self.trainable is None else self.trainable


@dataclass(frozen=True)
class ShardedPeak:
    """One rank's peak under FSDP over `world_size` ranks, and what it is made of."""

    world_size: int
    model_states: int  # this rank's shard of the weights and the optimizer state, plus the buffers
    gradients: int  # during forward and backward: sharded, or the whole model's unsharded within a window
    sharded_gradients: int  # this rank's shard of the gradients, at the optimizer step
    gathered: int  # unsharded parameters and gradients of the units alive at once
    activations: int
    step_temporaries: int  # this rank's shard of the optimizer step's temporaries

    @property
    def forward_backward(self) -> int:
        return self.model_states + self.gradients + self.gathered + self.activations

    @property
    def optimizer_step(self) -> int:
        return self.model_states + self.sharded_gradients + self.step_temporaries

    @property
    def peak(self) -> int:
        return max(self.forward_backward, self.optimizer_step)

    def to_json(self) -> dict:
        return {**asdict(self), "peak": self.peak}


def mixed_precision_step(measured: StepMemory, blocks: Blocks, master_bytes: int, compute_bytes: int) -> StepMemory:
    """The model states FSDP's mixed precision keeps, around activations measured with compute-dtype parameters (as
    FSDP2's MixedPrecisionPolicy runs forward and backward): the master weights (`master_bytes` per element), the
    gradients in the reduction dtype, and the optimizer state and its temporaries mirroring the master weights."""
    scale = master_bytes / compute_bytes
    return StepMemory(
        weights=blocks.parameters * master_bytes + measured.buffers,
        buffers=measured.buffers,
        gradients=blocks.with_gradients * REDUCE_BYTES,
        optimizer_state=round(measured.optimizer_state * scale),
        activations=measured.activations,
        weight_copies=0,  # the gathered parameters are already in the compute dtype: autocast copies nothing
        step_temporaries=round(measured.step_temporaries * scale),
        gradients_at_activation_peak=None if measured.gradients_at_activation_peak is None else round(
            measured.gradients_at_activation_peak * REDUCE_BYTES / compute_bytes),
        activations_at_gradient_peak=measured.activations_at_gradient_peak,
    )


def shard(nbytes: int, world_size: int) -> int:
    return -(-nbytes // world_size)


def gathered_parameters(blocks: Blocks, compute_bytes: int) -> int:
    """Unsharded parameters one rank holds at a time: the root's and the two largest blocks', in the compute dtype."""
    return (blocks.root + sum(sorted(blocks.blocks, reverse=True)[:PREFETCHED_BLOCKS])) * compute_bytes


def gathered_gradients(blocks: Blocks, compute_bytes: int) -> int:
    """One unit's unsharded gradients (compute dtype) and its reduce-scatter input (reduction dtype), in backward."""
    return max([blocks.root, *blocks.blocks]) * (compute_bytes + REDUCE_BYTES)


def sharded_peak(step: StepMemory, blocks: Blocks, world_size: int, compute_bytes: int,
                 unsharded_window: bool = False, offload: bool = False) -> ShardedPeak:
    """One rank's peak with `step`'s model states sharded over `world_size` ranks. `unsharded_window`: no_sync, the
    whole model's gradients held until the window's last backward (else `batch.sharded_gradients`); `offload`:
    CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer state in CPU memory."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (got {world_size})")
    sharded_gradients = 0 if offload else shard(step.gradients, world_size)
    early = step.gradients if step.gradients_at_activation_peak is None else step.gradients_at_activation_peak
    late = step.activations if step.activations_at_gradient_peak is None else step.activations_at_gradient_peak
    if unsharded_window:  # the earlier micro-batches' gradients stay unsharded, in fp32, through the window
        early_gradients = late_gradients = blocks.with_gradients * REDUCE_BYTES
    else:
        early_gradients, late_gradients = (0, 0) if offload else (shard(early, world_size), sharded_gradients)
    parameters = gathered_parameters(blocks, compute_bytes)
    # Forward and backward peak at one of two moments: the activations at their most (end of forward) with the
    # gradients there then, or the gradients at their most (end of backward) with the activations left and a
    # unit's unsharded gradients on their way to the reduce-scatter.
    gradients, gathered, activations = max(
        (early_gradients, parameters, step.activations),
        (late_gradients, parameters + gathered_gradients(blocks, compute_bytes), late),
        key=sum,
    )
    return ShardedPeak(
        world_size=world_size,
        model_states=(0 if offload else shard(step.weights - step.buffers + step.optimizer_state, world_size))
        + step.buffers,
        gradients=gradients,
        sharded_gradients=sharded_gradients,
        gathered=gathered,
        activations=activations,
        step_temporaries=0 if offload else shard(step.step_temporaries, world_size),
    )


def smallest_world_size(step: StepMemory, blocks: Blocks, limit_bytes: int, compute_bytes: int,
                        unsharded_window: bool = False, most: int = 1 << 16) -> int | None:
    """The fewest ranks (>= 2) whose peak fits `limit_bytes`, by bisection; None when `most` do not fit."""
    def fits(world_size: int) -> bool:
        return sharded_peak(step, blocks, world_size, compute_bytes, unsharded_window).peak <= limit_bytes

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


def unsharded_floor(step: StepMemory, blocks: Blocks, compute_bytes: int, unsharded_window: bool = False) -> int:
    """What no number of ranks shards away (buffers, gathered units, activations; no_sync's gradients)."""
    window = blocks.with_gradients * REDUCE_BYTES if unsharded_window else 0
    late = step.activations if step.activations_at_gradient_peak is None else step.activations_at_gradient_peak
    parameters = gathered_parameters(blocks, compute_bytes)
    return step.buffers + window + max(
        parameters + step.activations, parameters + gathered_gradients(blocks, compute_bytes) + late)
