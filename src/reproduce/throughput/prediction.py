"""How long a run takes, from its FLOPs: the predicted wall time of a plan, and MFU. Pure Python, no torch.

predicted seconds = optimizer steps x FLOPs per optimizer step / (devices x peak FLOP/s x MFU)

with the FLOPs counted once by probe/flops.py (model FLOPs: forward and backward of every sample of the effective
batch), the peak of the devices' datasheet for the run's precision (hardware/peaks.py), and an MFU that is assumed,
stated and sourced (`DEFAULT_MFU`, or --mfu). MFU (model FLOPs utilisation, Chowdhery et al. 2022, PaLM, appendix
B) is the run's model FLOP/s over the devices' peak; a device whose peak is unknown has no MFU, never a made-up one.
"""

from __future__ import annotations

DEFAULT_MFU = 0.40
MFU_SOURCE = (
    "assumed MFU 40%: the upper part of the range large training runs report, 21.3% (GPT-3) to 46.2% (PaLM 540B) "
    "(Chowdhery et al. 2022, arXiv 2204.02311, Table 3); set your own with --mfu"
)


def mfu(flops_per_second: float | None, devices: int, peak_flops: float | None) -> float | None:
    """Model FLOP/s over the devices' peak; None when either is unknown."""
    if not flops_per_second or not peak_flops or devices < 1:
        return None
    return flops_per_second / (devices * peak_flops)


def predicted_seconds(optimizer_steps: int | None, flops_per_step: float | None, devices: int,
                      peak_flops: float | None, assumed_mfu: float = DEFAULT_MFU) -> float | None:
    """The run's wall time by the FLOPs model; None when the steps, the FLOPs or the peak are unknown."""
    if optimizer_steps is None or not flops_per_step or not peak_flops or devices < 1 or assumed_mfu <= 0:
        return None
    return optimizer_steps * flops_per_step / (devices * peak_flops * assumed_mfu)
