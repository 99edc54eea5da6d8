"""GPUs by name, with their memory as the vendors' datasheets state it; peak FLOP/s and bandwidth by the same names
in peaks.py. No torch.

A datasheet's N GB is N GiB (an A100 80GB shows 81,920 MiB to `nvidia-smi`); a process can use a little less: the
CUDA context (`CONTEXT_BYTES`, taken off a budget from this catalog) and, on some cards, ECC (a T4 shows about 15 GiB
of 16). The probe's headroom covers the rest; `--memory` with `nvidia-smi`'s figure gives an exact budget.
`capability` decides PyTorch's attention kernel (probe/gpu_like.py); `cublaslt_workspace` adds to the margin."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..errors import UserError

GiB = 2**30
MiB = 2**20
DEFAULT_CAPABILITY = (8, 0)  # the estimate's GPU when only --memory is given: Ampere (A100), as most training cards
CONTEXT_BYTES = 512 * MiB  # the CUDA context and kernels: a few hundred MiB; bench/gpu_check.py measures it


@dataclass(frozen=True)
class Gpu:
    name: str
    title: str
    memory_gb: float  # as the datasheet states it
    memory_type: str
    architecture: str
    source: str

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GiB)

    @property
    def budget_bytes(self) -> int:
        """What a training process can plan to use: the card's memory less the CUDA context."""
        return self.memory_bytes - CONTEXT_BYTES

    @property
    def capability(self) -> tuple[int, int]:
        """CUDA compute capability (major, minor); AMD's CDNA3 is given Ampere's (its fused attention kernels)."""
        if self.architecture == "ampere":
            return (8, 0) if self.name.startswith("a100") else (8, 6)
        return {"hopper": (9, 0), "ada": (8, 9), "turing": (7, 5), "volta": (7, 0), "pascal": (6, 0)}.get(
            self.architecture, (8, 0))

    @property
    def cublaslt_workspace(self) -> int:
        if self.architecture == "hopper":
            return 32 * MiB
        if self.architecture == "ampere" and self.memory_gb >= 24:
            return 4 * MiB
        return 1 * MiB


_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
_GEFORCE = "https://www.nvidia.com/en-us/geforce/graphics-cards/"
GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("h200", "NVIDIA H200", 141, "HBM3e", "hopper", _NVIDIA + "h200/"),
        Gpu("h100-80gb", "NVIDIA H100 (SXM or PCIe) 80GB", 80, "HBM3 / HBM2e", "hopper", _NVIDIA + "h100/"),
        Gpu("h100-sxm", "NVIDIA H100 SXM 80GB", 80, "HBM3", "hopper", _NVIDIA + "h100/"),
        Gpu("h100-pcie", "NVIDIA H100 PCIe 80GB", 80, "HBM2e", "hopper", _NVIDIA + "h100/"),
        Gpu("h100-nvl", "NVIDIA H100 NVL", 94, "HBM3", "hopper", _NVIDIA + "h100/"),
        Gpu("a100-80gb", "NVIDIA A100 80GB", 80, "HBM2e", "ampere", _NVIDIA + "a100/"),
        Gpu("a100-40gb", "NVIDIA A100 40GB", 40, "HBM2", "ampere", _NVIDIA + "a100/"),
        Gpu("l40s", "NVIDIA L40S", 48, "GDDR6", "ada", _NVIDIA + "l40s/"),
        Gpu("l4", "NVIDIA L4", 24, "GDDR6", "ada", _NVIDIA + "l4/"),
        Gpu("a10g", "NVIDIA A10G (AWS G5)", 24, "GDDR6", "ampere", "https://aws.amazon.com/ec2/instance-types/g5/"),
        Gpu("a10", "NVIDIA A10", 24, "GDDR6", "ampere", _NVIDIA + "products/a10-gpu/"),
        Gpu("a40", "NVIDIA A40", 48, "GDDR6", "ampere", _NVIDIA + "a40/"),
        Gpu("rtx-a6000", "NVIDIA RTX A6000", 48, "GDDR6", "ampere",
            "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/"),
        Gpu("t4", "NVIDIA T4", 16, "GDDR6", "turing", _NVIDIA + "tesla-t4/"),
        Gpu("v100-32gb", "NVIDIA V100 32GB", 32, "HBM2", "volta", _NVIDIA + "v100/"),
        Gpu("v100-16gb", "NVIDIA V100 16GB", 16, "HBM2", "volta", _NVIDIA + "v100/"),
        Gpu("p100-16gb", "NVIDIA Tesla P100 16GB", 16, "HBM2", "pascal", _NVIDIA + "tesla-p100/"),
        Gpu("p100-sxm2", "NVIDIA Tesla P100 SXM2 16GB", 16, "HBM2", "pascal", _NVIDIA + "tesla-p100/"),
        Gpu("p100-pcie", "NVIDIA Tesla P100 PCIe 16GB", 16, "HBM2", "pascal", _NVIDIA + "tesla-p100/"),
        Gpu("rtx4090", "NVIDIA GeForce RTX 4090", 24, "GDDR6X", "ada", _GEFORCE + "40-series/rtx-4090/"),
        Gpu("rtx4080", "NVIDIA GeForce RTX 4080", 16, "GDDR6X", "ada", _GEFORCE + "40-series/rtx-4080-family/"),
        Gpu("rtx3090", "NVIDIA GeForce RTX 3090", 24, "GDDR6X", "ampere", _GEFORCE + "30-series/rtx-3090-3090ti/"),
        Gpu("rtx3080-10gb", "NVIDIA GeForce RTX 3080 10GB", 10, "GDDR6X", "ampere",
            _GEFORCE + "30-series/rtx-3080-3080ti/"),
        Gpu("mi300x", "AMD Instinct MI300X", 192, "HBM3", "cdna3",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    )
}


# Bare names the papers use, read as the card they most likely mean (said in the README's papers table).
ALIASES = {
    "v100": "v100-16gb",  # the V100 launched with 16 GB; the 32 GB card is always written as such
    "a100": "a100-40gb",  # nanoGPT's shakespeare-char "1 A100": the 40 GB card of its GPT-2 run (any A100 fits it)
    "p100-sxm2-16gb": "p100-sxm2",  # torch.cuda.get_device_name()'s "Tesla P100-SXM2-16GB"
    "p100-pcie-16gb": "p100-pcie",
}
NOT_GPUS = ("tpu",)  # accelerators the estimate cannot model (not CUDA: other kernels, other memory)


def lookup(name: str) -> Gpu:
    """The catalog entry for `name` (case and separators forgiven); a UserError naming the known ones."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    if any(word in key for word in NOT_GPUS):
        raise UserError(
            f"{name!r} is a TPU, not a GPU: the estimate models CUDA's attention kernels, dropout, autocast "
            "and caching allocator, and has nothing to say about a TPU's memory; give `memory` SIZE to plan for its "
            "memory as if it were a GPU", field="gpu"
        )
    squashed = {k.replace("-", ""): k for k in GPUS}
    if key.replace("-", "") in squashed:
        return GPUS[squashed[key.replace("-", "")]]
    close = [k for k in GPUS if k.startswith(key)] or difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f"did you mean {' or '.join(repr(k) for k in close)}? " if close else ""
    raise UserError(f"unknown GPU {name!r}; {hint}known: {', '.join(GPUS)} (or give `memory` SIZE)", field="gpu")
