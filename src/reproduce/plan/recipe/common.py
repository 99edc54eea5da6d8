"""What every section of the recipe builds on: the strict base model, lengths, builders (builtin or factory)."""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

LENGTH_UNITS = ("steps", "epochs", "samples", "tokens")

Name = TypeVar("Name")


def _one_or_many(value: Any) -> Any:
    """A single name where a list of names is expected: `norm_layers: batchnorm` reads as `[batchnorm]`."""
    return [value] if isinstance(value, str) else value


# A list of names that also accepts one name written alone (YAML users write `no_decay: bias` as often as `[bias]`).
Names = Annotated[list[Name], BeforeValidator(_one_or_many)]
# [height, width] in pixels, or one side for both: `crop: 513` reads as [513, 513]
Sides = Annotated[
    tuple[int, int] | None,
    BeforeValidator(lambda value: [value, value] if isinstance(value, int) and not isinstance(value, bool) else value),
]


class Strict(BaseModel):
    # no field takes inf or nan; a number is never `true` (pydantic would read it as 1)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if not isinstance(value, bool) or field is None:
                    continue
                kinds, stack = set(), [field.annotation]  # a number (int, float, or an optional one), not a bool
                while stack:
                    kind = stack.pop()
                    arguments = typing.get_args(kind)
                    if arguments:
                        stack.extend(arguments)
                    else:
                        kinds.add(kind)
                if kinds & {int, float} and bool not in kinds:
                    raise ValueError(f"{name}: expected a number (got {value!r})")
        return data


class OneUnit(Strict):
    """A quantity given in exactly one of `UNITS` (each an optional field of the subclass)."""

    UNITS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="after")
    def _one_unit(self) -> OneUnit:
        given = self.units_given
        if len(given) != 1 and not self._allows_none():
            raise ValueError(f"give exactly one of {', '.join(self.UNITS)} (got {', '.join(given) or 'none'})")
        return self

    def _allows_none(self) -> bool:
        return False

    @property
    def units_given(self) -> list[str]:
        return [unit for unit in self.UNITS if getattr(self, unit) is not None]

    @property
    def unit(self) -> str:
        return self.units_given[0]

    @property
    def value(self) -> float:
        value: float = getattr(self, self.unit)
        return value


class Length(OneUnit):
    """A length in exactly one unit: optimizer steps, epochs, samples (sequences) or tokens."""

    UNITS: ClassVar[tuple[str, ...]] = LENGTH_UNITS

    steps: int | None = Field(default=None, ge=0)
    epochs: float | None = Field(default=None, ge=0)
    samples: int | None = Field(default=None, ge=0)
    tokens: int | None = Field(default=None, ge=0)

    def label(self) -> str:
        """The length as written in messages and tables: "90 epochs", "4e+09 tokens"."""
        return f"{self.value:g} {self.unit}"


class Builder(Strict):
    """A built-in name, or `factory: "package.module:function"` with keyword arguments."""

    builtin: str | None = None
    factory: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    kwargs: dict[str, Any] = {}

    @model_validator(mode="after")
    def _one_source(self) -> Builder:
        if self.builtin is not None and self.factory is not None:
            raise ValueError("give either builtin or factory, not both")
        return self
