"""The recipe's `budget:` section: what the user allows the whole run to cost, checked at `plan` time against the
forecast (throughput/budget.py) and, during the run, by the cost gate.

`budget: {gpu_hours: 40}` (GPUs x hours: 8 GPUs for 5 hours is 40), or `money: 500` with the price of one GPU-hour
(`price:` here, or `reproduce plan --price`): no price is shipped as a fact, the user says what theirs is.
`--set budget.gpu_hours=40` sets it from the command line like any recipe field.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .common import Strict


class Budget(Strict):
    gpu_hours: float | None = Field(
        default=None, gt=0, description="the most GPU-hours (GPUs x hours) the whole run may take")
    money: float | None = Field(
        default=None, gt=0, description="the most money the whole run may cost, in `currency`: GPU-hours x the "
        "price of one (`price`, or `plan --price`)")
    price: float | None = Field(
        default=None, gt=0, description="the price of one GPU-hour, in `currency` (the user's own; none is shipped)")
    currency: str | None = Field(default=None, min_length=1, max_length=8, pattern=r"^\S+$",
                                 description="the unit `money` and `price` are in, as printed (USD, EUR, credits)")

    @model_validator(mode="after")
    def _something_bounded(self) -> Budget:
        if self.gpu_hours is None and self.money is None:
            raise ValueError("give gpu_hours or money (or both): the most the whole run may cost")
        return self
