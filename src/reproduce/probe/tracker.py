"""Live tensor storage bytes, counted exactly, on any device (also under `FakeTensorMode`).

`MemoryTracker` is a `TorchDispatchMode`: each storage an operator returns is charged once, rounded up to 512 bytes
(as CUDA's caching allocator rounds), and released when freed (`weakref.finalize`); `charge()` adds what existed
before. `peak` is the most live since `reset_peak()`. A storage's category is the current `phase` (default
`activations`), what `charge()` and `retag()` name, or `weight copies` for autocast's; `live_by`, `peak_by` (at the
peak, summing to `peak`), `most_by` (per phase), `when_most` (all categories when activations or gradients were at
their most), `peak_stage` and `marked_most` (storages made while `marking`: logits, loss) break it down. The GPU
rules (gpu_like.py) add `workspace(nbytes)` and `allowance` (`ALLOWANCE` in `peak_by`), counted in `peak`, never in
`live` nor the budget. Over a budget an operator raises `torch.OutOfMemoryError`, as CUDA does. On a CPU its peaks
equal `torch.distributed._tools.mem_tracker.MemTracker`'s within 0.03%, at about twice its speed (PyTorch 2.13).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ..plan.units import format_size

GRANULE = 512  # bytes: the CUDA caching allocator's rounding of every block
WEIGHTS, WEIGHT_COPIES, GRADIENTS, OPTIMIZER, ACTIVATIONS = (
    "weights", "weight copies", "gradients", "optimizer", "activations")
ALLOWANCE = "kernels' workspaces (allowance)"  # counted at the peak only: see `MemoryTracker.allowance`


def rounded(value: int, multiple: int = GRANULE) -> int:
    return -(-value // multiple) * multiple


class MemoryTracker(TorchDispatchMode):
    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live = 0
        self.peak = 0
        self._phase = ACTIVATIONS  # the category of what operators allocate now
        self.live_by: dict[str, int] = {}
        self.peak_by: dict[str, int] = {}
        self.most_by: dict[tuple[str, str], int] = {}  # (phase, category) -> the most that category held
        self.when_most: dict[tuple[str, str], dict[str, int]] = {}  # (phase, category) -> live_by at that moment
        self._sizes: dict[int, tuple[int, str]] = {}  # storage (its C++ address, unique while alive) -> bytes, category
        self.peak_stage = "forward"  # forward, backward or the optimizer step: where the peak was reached
        self.marking = False  # storages made while True are also counted in `marked` (the logits and the loss)
        self._marked: set[int] = set()
        self.marked_live = self.marked_most = 0
        self.allowance = 0.0  # a share of the live activations counted on top of them in `peak` (see the notes)
        self.workspaces: dict = {}  # operator -> bytes(args, kwargs) it allocates and frees inside itself

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        self._note_most()

    def most(self, category: str, phase: str | None = None) -> int:
        """The most `category` held during `phase` (any phase when None) since the last `reset_peak()`."""
        return max((v for (p, c), v in self.most_by.items() if c == category and phase in (None, p)), default=0)

    def charge(self, tensors: Iterable, category: str | None = None) -> None:
        """Count tensors created outside the mode (parameters, buffers, optimizer state, inputs)."""
        for value in tree_leaves(list(tensors)):
            self._add(value, category or self.phase)
        self._check()

    def retag(self, tensors: Iterable, category: str) -> None:
        """Move the storage of tensors already counted to `category` (gradients once accumulated, ...)."""
        for value in tree_leaves(list(tensors)):
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                key = value.untyped_storage()._cdata
                known = self._sizes.get(key)
                if known is not None and known[1] != category:
                    self._move(known[0], known[1], category)
                    self._sizes[key] = (known[0], category)

    def mark(self, tensors: Iterable) -> None:
        """Count tensors already counted in `marked` too (the model's output, before the loss reads it)."""
        for value in tree_leaves(list(tensors)):
            if isinstance(value, torch.Tensor) and value.layout == torch.strided:
                key = value.untyped_storage()._cdata
                if key in self._sizes and key not in self._marked:
                    self._marked.add(key)
                    self._note_marked(self._sizes[key][0])

    def _note_marked(self, size: int) -> None:
        self.marked_live += size
        self.marked_most = max(self.marked_most, self.marked_live)

    def reset_peak(self) -> None:
        self.peak = -1
        self.most_by = {}
        self.when_most = {}
        self.marked_most = self.marked_live
        self._note_peak()
        self.peak_stage = "forward"
        self._note_most()

    def workspace(self, nbytes: int) -> None:
        """A buffer of `nbytes` that an operator allocates and frees inside itself: live for this moment only."""
        size = rounded(nbytes)
        if size <= 0:
            return
        self.live += size
        self._move(size, None, ACTIVATIONS)
        self._note_peak()
        self.live -= size
        self._move(size, ACTIVATIONS, None)

    def _note_peak(self) -> None:
        """A new peak, when the live tensors and the allowance on the live activations are more than the last."""
        extra = math.ceil(self.allowance * max(0, self.live_by.get(ACTIVATIONS, 0))) if self.allowance else 0
        if self.live + extra > self.peak:
            self.peak = self.live + extra
            self.peak_by = dict(self.live_by)
            if extra:
                self.peak_by[ALLOWANCE] = extra
            # autograd's engine runs a graph task only in backward (checkpointed blocks recompute there too)
            self.peak_stage = "backward" if torch._C._current_graph_task_id() != -1 else (
                "optimizer step" if self._phase == "optimizer step" else "forward")

    def _move(self, size: int, source: str | None, target: str | None) -> None:
        if source is not None:
            self.live_by[source] -= size
        if target is not None:
            self.live_by[target] = self.live_by.get(target, 0) + size
            self._note_most(target)

    def _note_most(self, category: str | None = None) -> None:
        for name in [category] if category else list(self.live_by):
            key = (self.phase, name)
            value, most = self.live_by[name], self.most_by.get(key, 0)
            if value > most:
                self.most_by[key] = value
            if name in (ACTIVATIONS, GRADIENTS) and value >= most and value:  # what coexisted with them, at the
                self.when_most[key] = dict(self.live_by)  # latest such moment (a window's later micro-batches)

    def _add(self, value, category: str) -> None:
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            return
        if is_traceable_wrapper_subclass(value):  # a DTensor: its own storage is nominal; count what it wraps (its
            for name in value.__tensor_flatten__()[0]:  # local tensor is made inside its dispatch, unseen here)
                self._add(getattr(value, name), category)
            return
        storage = value.untyped_storage()
        key, size = storage._cdata, rounded(storage.nbytes())
        known = self._sizes.get(key)
        if known is None:
            if size == 0:
                return
            weakref.finalize(storage, self._release, key)
        elif known[0] == size:
            return
        else:
            category = known[1]  # resized in place (`out=` operators, `resize_`): it stays what it was
            self._move(known[0], category, None)
        self._sizes[key] = (size, category)
        self.live += size - (known[0] if known else 0)
        self._move(size, None, category)
        if self.marking and known is None:
            self._marked.add(key)
            self._note_marked(size)
        self._note_peak()

    def _release(self, key: int) -> None:
        size, category = self._sizes.pop(key, (0, None))
        self.live -= size
        if key in self._marked:
            self._marked.discard(key)
            self.marked_live -= size
        if category is not None:
            self.live_by[category] -= size

    def _check(self) -> None:
        if self.budget_bytes is not None and self.live > self.budget_bytes:
            raise torch.OutOfMemoryError(
                f"tracked tensors need {format_size(self.live)}, over the budget of {format_size(self.budget_bytes)}"
            )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = self.live
        category = self.phase
        source = args[0] if func is torch.ops.aten._to_copy.default else None
        if isinstance(source, torch.Tensor) and source.layout == torch.strided:
            known = self._sizes.get(source.untyped_storage()._cdata)
            if known and known[1] in (WEIGHTS, WEIGHT_COPIES):  # autocast's compute copy of a weight
                category = WEIGHT_COPIES
        for value in tree_leaves(out):
            self._add(value, category)
        if self.live > before:  # only an operator that allocates can run out of memory, as on a GPU
            self._check()
        sizer = self.workspaces.get(func)
        if sizer is not None:
            self.workspace(sizer(args, kwargs or {}))
        return out
