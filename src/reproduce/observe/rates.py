"""Each optimizer step's throughput for metrics.jsonl, and their medians for summary.json: `samples_per_second`
(the whole window's samples over every process, over the step's wall time, data waits included),
`tokens_per_second`, `flops_per_second` (model FLOPs counted once at the first step, probe/flops.py) and `mfu`
(over every device's peak for the precision; null when unknown, as on a CPU).
"""

from __future__ import annotations

import statistics

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import UserError
from ..hardware.peaks import identify, on_card, peaks_of, precision_key


def mfu(flops_per_second: float | None, devices: int, peak_flops: float | None) -> float | None:
    """Model FLOP/s over the devices' peak (MFU, Chowdhery et al. 2022, appendix B); None when either is unknown."""
    if not flops_per_second or not peak_flops or devices < 1:
        return None
    return flops_per_second / (devices * peak_flops)


FIELDS = ("samples_per_second", "tokens_per_second", "useful_tokens_per_second", "flops_per_second", "mfu")


class StepRates:
    """Each step's rates. The model FLOPs of a sample and the device's peak are counted once, when the first step's
    rates need them (off the way to the first step); a factory's model at the start instead (`count`), as its
    forward may return what no loss takes, which is one line before anything is written."""

    def __init__(self, plan, setup, world_size: int):
        self.recipe, self.device, self.data = plan.recipe, setup.device, setup.data
        self.sequence_length = plan.recipe.batch.sequence_length
        # variable-length text: the input tokens of the sample the FLOPs were counted on (the longest), so a step's
        # FLOPs are those of the tokens it computed (padding included), not of every sample at the longest's
        self.counted_length: int | None = None
        self.world_size = world_size
        self.notes: list[str] = []
        self.counted = False
        self.flops = self.gpu = self.peak = self.precision = self.peak_note = None

    def count(self) -> list[str]:
        """Count the FLOPs and find the peak, once; the notes it gave (why a figure is null)."""
        if self.counted:
            return []
        self.counted = True
        try:
            from ..probe.flops import recipe_flops

            # the run's random streams stay as they were; a memory tracker around the run (the tests' budgets)
            # charges the run's own tensors, not the count's fake model, now that the run's state is live
            with torch.random.fork_rng(devices=[]), _disable_current_modes():
                self.flops = recipe_flops(self.recipe, self.data)
        except UserError:  # the model's output is no loss's input (a ModelOutput): it cannot train either
            raise
        except Exception as error:  # an auxiliary count: a model the counter cannot trace still trains
            if "meta device" in str(error):  # the model's own code reads weights (a factory calling from_pretrained)
                self.notes.append("FLOPs not counted: they are counted on a model built without memory (the meta "
                                  "device), and this model's factory loads weights, which needs real memory; give "
                                  "the weights as model.weights instead: flops_per_second and mfu are null")
            else:
                self.notes.append(f"FLOPs not counted ({type(error).__name__}: {str(error).splitlines()[0][:120]}): "
                                  "flops_per_second and mfu are null")
        if self.device.type == "cuda":
            properties = torch.cuda.get_device_properties(self.device)
            self.gpu = identify(properties.name, properties.total_memory / 2**30)
            conv = self.flops is not None and self.flops.convolution_share > 0.5
            tf32 = torch.backends.cuda.matmul.allow_tf32 or (conv and torch.backends.cudnn.allow_tf32)
            self.precision = on_card(precision_key(self.recipe.precision, tf32), (properties.major, properties.minor))
            peaks = peaks_of(self.gpu)
            self.peak = peaks.flops(self.precision) if peaks else None
            if self.peak is None:
                self.notes.append(f"mfu null: no datasheet peak for {properties.name} in {self.precision}")
        self.peak_note = None if self.peak else (
            f"mfu null: no datasheet peak known for the {self.device.type} device" if self.device.type != "cuda"
            else self.notes[-1])
        return list(self.notes)

    def fields(self, record: dict, say=None) -> dict:
        """A step's rates; `say(note)` for each note of the count when this step counts (the first)."""
        seconds = record.get("seconds") or 0
        if seconds <= 0:
            return {}
        for note in self.count():
            if say is not None:
                say(note)
        samples = record["samples"] / seconds
        length = record.get("sequence_length") or self.sequence_length  # batch phases: this step's length
        flops = None
        computed = record.get("padded_tokens")
        if self.flops is not None and computed and self.counted_length:  # the tokens computed, at FLOPs per token
            flops = computed / seconds * self.flops.per_sample / self.counted_length
        elif self.flops is not None:  # another length than the counted one: its FLOPs in proportion (per token)
            flops = samples * self.flops.per_sample * (length / self.sequence_length if length else 1)
        fields = {"samples_per_second": round(samples, 4)}
        if length:  # token batches only
            fields["tokens_per_second"] = round(samples * length, 2)
        if record.get("useful_tokens") is not None:  # variable-length text: input tokens, padding left out
            fields["useful_tokens_per_second"] = round(record["useful_tokens"] / seconds, 2)
        value = mfu(flops, self.world_size, self.peak)
        fields["flops_per_second"] = round(flops, 1) if flops is not None else None
        fields["mfu"] = round(value, 6) if value is not None else None
        return fields

    def summary(self, records: list[dict]) -> dict:
        """Medians over the steps of metrics.jsonl (the steps before a resume count too)."""
        self.count()
        steps = [r for r in records if "samples_per_second" in r]

        def median(field: str) -> float | None:
            values = [r[field] for r in steps if r.get(field) is not None]
            return statistics.median(values) if values else None

        return {
            **{f"median_{field}": median(field) for field in FIELDS},
            "flops_per_sample": self.flops.per_sample if self.flops is not None else None,
            "gpu": self.gpu, "precision": self.precision, "peak_flops": self.peak, "devices": self.world_size,
            "notes": self.notes + ([self.peak_note] if self.peak_note and self.peak_note not in self.notes else []),
        }
