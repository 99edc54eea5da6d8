"""GPUs by name, with their memory as the vendors' datasheets state it. No torch.

`--gpu a100-80gb` plans for that card's memory. The datasheets' "GB" of GPU memory are binary: an
A100 40GB shows 40,960 MiB to `nvidia-smi`, an A100 80GB 81,920 MiB; so a figure of N GB is taken as
N GiB. What a process can use is a little less: the CUDA context (a few hundred MiB, taken off as
`CONTEXT_BYTES` when the budget comes from this catalog) and, on some cards, memory reserved for ECC
(a T4 shows about 15 GiB of its 16). The probe's headroom (10% by default) covers the rest; give
`--memory` with the figure `nvidia-smi` shows for an exact budget.

`cublaslt_workspace` is the cuBLASLt workspace PyTorch allocates per handle on that architecture
(1 MiB by default, 4 MiB on Ampere cards with 24 GB or more, 32 MiB on Hopper); the estimate meter
adds it to its margin.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from ..errors import UserError

GiB = 2**30
MiB = 2**20
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
    def cublaslt_workspace(self) -> int:
        if self.architecture == "hopper":
            return 32 * MiB
        if self.architecture == "ampere" and self.memory_gb >= 24:
            return 4 * MiB
        return 1 * MiB


_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
GPUS = {
    gpu.name: gpu
    for gpu in (
        Gpu("h200", "NVIDIA H200", 141, "HBM3e", "hopper", _NVIDIA + "h200/"),
        Gpu("h100-80gb", "NVIDIA H100 (SXM or PCIe) 80GB", 80, "HBM3 / HBM2e", "hopper", _NVIDIA + "h100/"),
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
        Gpu("rtx4090", "NVIDIA GeForce RTX 4090", 24, "GDDR6X", "ada",
            "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"),
        Gpu("rtx4080", "NVIDIA GeForce RTX 4080", 16, "GDDR6X", "ada",
            "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4080-family/"),
        Gpu("rtx3090", "NVIDIA GeForce RTX 3090", 24, "GDDR6X", "ampere",
            "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3090-3090ti/"),
        Gpu("rtx3080-10gb", "NVIDIA GeForce RTX 3080 10GB", 10, "GDDR6X", "ampere",
            "https://www.nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3080-3080ti/"),
        Gpu("mi300x", "AMD Instinct MI300X", 192, "HBM3", "cdna3",
            "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
    )
}


def lookup(name: str) -> Gpu:
    """The catalog entry for `name` (case and separators forgiven); a UserError naming the known ones."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in GPUS:
        return GPUS[key]
    squashed = {k.replace("-", ""): k for k in GPUS}
    if key.replace("-", "") in squashed:
        return GPUS[squashed[key.replace("-", "")]]
    close = [k for k in GPUS if k.startswith(key)] or difflib.get_close_matches(key, list(GPUS), n=1)
    hint = f"did you mean {' or '.join(repr(k) for k in close)}? " if close else ""
    raise UserError(f"--gpu: unknown GPU {name!r}; {hint}known: {', '.join(GPUS)} (or give --memory SIZE)")
