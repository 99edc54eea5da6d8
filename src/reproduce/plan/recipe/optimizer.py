"""The recipe's `optimizer:` section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .common import Names, Strict

OptimizerName = Literal["sgd", "nesterov", "adam", "adamw", "lamb", "lars", "adafactor"]
SGD_FAMILY = ("sgd", "nesterov", "lars")  # the others (adam, adamw, lamb, adafactor) are Adam's family
Implementation = Literal["foreach", "fused", "for-loop"]
IMPLEMENTED_BY_TORCH = ("sgd", "nesterov", "adam", "adamw", "adafactor")


class Optimizer(Strict):
    name: OptimizerName
    lr: float = Field(gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    no_decay: Names[Literal["bias", "norm", "embedding", "1d"]] = []
    trust_coefficient: float | None = Field(
        default=None, gt=0, description="lars: eta, the trust coefficient of You et al. 2017 (default 0.001)"
    )
    state_bits: Literal[32, 8] = Field(
        default=32, description="adam/adamw: 8 keeps the two moments in 8 bits, blockwise quantised (bitsandbytes' "
        "AdamW8bit, Dettmers et al. 2022, arXiv 2110.02861): about 2 bytes a parameter instead of 8",
    )
    paged: bool = Field(
        default=False, description="adam/adamw: bitsandbytes' paged optimizer (QLoRA's paged_adamw_32bit): its state "
        "in CUDA unified memory, paged out to the CPU when the GPU runs short instead of running out of memory",
    )
    implementation: Implementation | None = Field(
        default=None, description="torch.optim's kernels (sgd, nesterov, adam, adamw, adafactor): foreach (one "
        "kernel over a list of tensors: temporaries the size of all the parameters), fused (one kernel per "
        "parameter group, no such temporaries; adam, adamw, sgd) or for-loop (one parameter at a time); default: "
        "PyTorch's choice, foreach on CUDA, for-loop on a CPU",
    )
    in_backward: bool = Field(
        default=False, description="step the optimizer inside backward, each parameter as its gradient is made "
        "(torchtune's optimizer_in_bwd): not with gradient accumulation, refused",
    )

    @model_validator(mode="after")
    def _betas(self) -> Optimizer:
        for beta in self.betas:
            if not 0 <= beta < 1:
                raise ValueError(f"betas: each must be in [0, 1) (got {list(self.betas)})")
        if self.name == "nesterov" and self.momentum == 0:
            raise ValueError("momentum: nesterov needs momentum > 0")
        if self.trust_coefficient is not None and self.name != "lars":
            raise ValueError(f"trust_coefficient: only used by lars (name is {self.name})")
        if self.in_backward:
            raise ValueError(
                "in_backward: an optimizer stepped in backward frees each gradient as soon as it is made, and "
                "accumulation needs every micro-batch's gradients held until the window ends: the two cannot be "
                "exact together; leave in_backward out (activation checkpointing, a chunked loss or offloading save "
                "memory and keep the accumulation exact)")
        if self.implementation is not None and self.name not in IMPLEMENTED_BY_TORCH:
            raise ValueError(f"implementation: only for torch.optim's {', '.join(IMPLEMENTED_BY_TORCH)} "
                             f"(name is {self.name}, whose step is train/optim/large_batch.py's own)")
        if self.implementation == "fused" and self.name not in ("sgd", "nesterov", "adam", "adamw"):
            raise ValueError(f"implementation: fused: torch.optim has no fused {self.name} (fused: adam, adamw, sgd)")
        if self.implementation is not None and self.bitsandbytes:
            raise ValueError("implementation: bitsandbytes' paged and 8-bit optimizers step with their own kernels "
                             "(one parameter at a time); leave implementation out")
        if self.bitsandbytes and self.name not in ("adam", "adamw"):
            field = "paged" if self.paged else "state_bits"
            raise ValueError(f"{field}: bitsandbytes' paged and 8-bit optimizers are adam and adamw (name is "
                             f"{self.name})")
        return self

    @property
    def bitsandbytes(self) -> bool:
        """Stepped by a bitsandbytes optimizer (paged, or 8-bit state) rather than torch.optim's."""
        return self.paged or self.state_bits != 32

    @property
    def bitsandbytes_class(self) -> str | None:
        """The bitsandbytes.optim class that steps it (PagedAdamW32bit, AdamW8bit, PagedAdam8bit, ...), or None."""
        if not self.bitsandbytes:
            return None
        return ("Paged" if self.paged else "") + ("AdamW" if self.name == "adamw" else "Adam") + (
            "8bit" if self.state_bits == 8 else "32bit" if self.paged else "")

    @property
    def family(self) -> str:
        return "sgd" if self.name in SGD_FAMILY else "adam"
