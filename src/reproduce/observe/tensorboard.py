"""`reproduce run --tensorboard`: every numeric field of each metrics record as a TensorBoard scalar.

metrics.jsonl stays the source of truth; this is a view of it. Records are written at their optimizer `step`
(`train/loss`, `train/lr`, ..., and `eval/loss`, `eval/accuracy` for the `eval_*` fields); records without a
step or with an `event` key (out-of-memory notes) are skipped. Booleans are logged as 0/1.

Nothing is written to the folder before the first record (or `open`), so `reproduce run`'s check that --out
is empty still sees an empty folder. A run resumed after step K opens with `purge_step=K+1`: TensorBoard drops
the older events past the checkpoint, as metrics.jsonl is truncated to it.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def scalars(record: dict) -> dict[str, float]:
    """The TensorBoard tags and values of one metrics record (numeric fields other than `step`)."""
    values = {}
    for key, value in record.items():
        if key == "step" or not isinstance(value, (int, float)):
            continue
        tag = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
        values[tag] = float(value)
    return values


class TensorboardLog:
    """Scalars under `out_dir` (give it `RUN/tensorboard`); `tensorboard --logdir RUN/tensorboard` shows them."""

    def __init__(self, out_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "needs the tensorboard package, which is not installed (pip install tensorboard); "
                "metrics.jsonl has the same numbers", field="tensorboard"
            ) from None
        self.out_dir = Path(out_dir)
        self._writer_class = SummaryWriter
        self.writer = None

    def open(self, first_step: int = 0) -> None:
        """Start writing: a fresh run (`first_step` 0) replaces earlier event files; a resumed one purges after it."""
        if self.writer is not None:
            return
        if first_step == 0 and self.out_dir.is_dir():
            for old in self.out_dir.glob("events.out.tfevents.*"):
                old.unlink()
        self.writer = self._writer_class(log_dir=str(self.out_dir), purge_step=first_step + 1 if first_step else None)

    def write(self, record: dict) -> None:
        step = record.get("step")
        if "event" in record or not isinstance(step, int) or isinstance(step, bool):
            return
        self.open()
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()  # once per optimizer step: an interrupted run keeps what it logged

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

