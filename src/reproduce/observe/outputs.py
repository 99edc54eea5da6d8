"""What a run leaves in its folder: the folder's guard (never overwrite another run), metrics.jsonl, the loss plot.
No torch here: `reproduce check` reads metrics and plots without it."""

from __future__ import annotations

import contextlib
import json
import math
from html import escape
from pathlib import Path

from ..errors import UserError
from ..storage.files import TEMPORARY, WriteFailed, check_torch_file, write_atomic
from ..storage.lock import LOCK_NAME


def check_out_dir(out: Path, resume: bool, force: bool) -> None:
    """Never overwrite another run: a non-empty folder needs --resume (same run) or --force."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder", field="out")
    if resume:
        if not (out / "checkpoints" / "last.pt").is_file():
            raise UserError(f"{out} has no checkpoints/last.pt to resume from", field="resume")
        return
    if out.is_dir() and any(entry.name != LOCK_NAME and not TEMPORARY.match(entry.name) for entry in out.iterdir()) \
            and not force:  # (a dead writer's temporaries go when the run takes the lock: storage/lock.py)
        runs = [name for name in OUTPUTS if (out / name).exists()]
        names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in out.iterdir()
                       if entry.name != LOCK_NAME)
        holds = (f"it holds another run: {', '.join(runs)}" if runs else f"it holds {', '.join(names[:3])}"
                 + (f" and {len(names) - 3} more" if len(names) > 3 else "") + ", not a run of reproduce")
        raise UserError(f"{out} is not empty ({holds}); " + (
            "pass `resume` to continue it, `force` to overwrite its outputs, or choose another folder"
            if runs else
            "choose another folder (`force` would keep these files and write the run's outputs beside them)"
        ), field="out")


# loss.png: the plot of runs before loss.svg, still another run's output here
OUTPUTS = ("plan.yaml", "metrics.jsonl", "summary.json", "model.pt", "loss.svg", "loss.png", "checkpoints/last.pt")
FOLDERS = ("tensorboard", "wandb", "mlflow", "adapter", "merged")  # trackers' runs, models/weights.py
SHARDED_PREFIX = "sharded-step-"  # a sharded run's checkpoint folders (train/resume.py)


def run_outputs(out: Path) -> list[str]:
    """The names (relative to `out`) of everything a run writes there, and nothing else: what --force sets aside."""
    sharded = sorted(f"checkpoints/{p.name}" for p in (out / "checkpoints").glob(f"{SHARDED_PREFIX}*"))
    return [*OUTPUTS, *sharded, *FOLDERS, "trackers.json"]


class MetricsLog:
    """metrics.jsonl, appended and flushed once per optimizer step by rank 0. What it wrote (`kept`) goes into each
    checkpoint, so a resume cuts back, or rewrites from that copy, a file cut short, deleted or garbled since
    (`repaired` says what was wrong)."""

    def __init__(self, path: Path, kept: bytes | int | None, enabled: bool):
        """`kept`: metrics.jsonl at the checkpoint resumed from (or its length: `kept_metrics`; None: a new run)."""
        self.path, self.handle, self.kept, self.repaired = path, None, bytearray(), None
        if not enabled:
            return
        try:
            if isinstance(kept, int):  # the checkpoint holds the lines' length, not the lines
                self.repaired = _cut_back(path, kept)
                self.kept = bytearray(path.read_bytes()[:kept]) if path.exists() else bytearray()
            elif kept is not None:
                self.kept = bytearray(kept)
                self.repaired = _restore(path, kept)
            self.handle = open(path, "wb" if kept is None else "ab")  # noqa: SIM115 (closed in close())
        except OSError as error:
            raise WriteFailed(path, error) from None

    def write(self, record: dict) -> None:
        if self.handle:
            line = (json.dumps(record) + "\n").encode("utf-8")
            try:
                self.handle.write(line)
                self.handle.flush()
            except OSError as error:
                raise WriteFailed(self.path, error) from None
            self.kept += line

    def close(self) -> None:
        if self.handle:
            with contextlib.suppress(OSError):  # (a full disk: the write that failed said so)
                self.handle.close()


def _restore(path: Path, kept: bytes) -> str | None:
    """metrics.jsonl cut back to `kept`, or rewritten from it when missing, shorter or different; why, or None."""
    held = path.read_bytes() if path.exists() else None
    if held is not None and held.startswith(kept):
        if len(held) > len(kept):
            with open(path, "r+b") as handle:
                handle.truncate(len(kept))  # drop lines written after the checkpoint we resume from
        return None
    write_atomic(path, kept)
    if held is None:
        return f"{path} was missing: rewritten from the checkpoint"
    pairs = zip(held.split(b"\n"), kept.split(b"\n"), strict=False)
    line = next((n for n, (a, b) in enumerate(pairs, 1) if a != b), None)
    why = f"line {line} differs from what the run wrote" if line else "it is shorter than at the checkpoint"
    return f"{path}: {why}: rewritten from the checkpoint"


def _cut_back(path: Path, offset: int) -> str | None:
    """metrics.jsonl cut back to `offset` bytes; a shorter one keeps its whole lines (truncate would pad NULs)."""
    size = path.stat().st_size if path.exists() else 0
    held = path.read_bytes() if size < offset else b""
    whole = held[: held.rfind(b"\n") + 1]
    with open(path, "a+b") as handle:
        handle.truncate(offset if size >= offset else len(whole))
    if size >= offset:
        return None
    return f"{path} is shorter than at the checkpoint ({size} of {offset} bytes): its whole lines kept"


def missing_final_outputs(out: Path, step: int) -> str | None:
    """What of a run's end at `step` is missing or damaged, or None (summary.json, written last, names the rest)."""
    path = out / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as error:
        return f"{path} is damaged ({error})"
    if not isinstance(summary, dict) or summary.get("steps") != step:
        return f"{path} is not of step {step}"
    model = out / "model.pt"
    damaged = check_torch_file(model) if model.is_file() else "missing"
    if damaged:
        return f"{model} is {damaged}"
    folders = [out / name for name in ("adapter", "merged") if summary.get(name)]
    plot = summary.get("plot")
    if isinstance(plot, str) and plot.endswith((".svg", ".png")):  # (a note when no plot was made, before loss.svg)
        folders.append(out / Path(plot).name)
    return next((f"{path} is missing" for path in folders if not path.exists()), None)


def read_metrics(path: str | Path) -> list[dict]:
    """metrics.jsonl's records; a line that is not a JSON record is named (UserError), never a traceback."""
    records = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise UserError(f"{path}: line {number} is not a JSON record ({error})") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}: line {number} is not a JSON record (a {type(record).__name__})")
            records.append(record)
    return records


def plot_metrics(metrics_path: Path, svg: Path) -> str:
    """The loss curve of metrics.jsonl as an SVG file (`loss_svg`); returns its path."""
    write_atomic(svg, loss_document(read_metrics(metrics_path)).encode("utf-8"))
    return str(svg)


def loss_document(metrics: bytes | list[dict]) -> str:
    """The SVG `plot_metrics` writes for metrics.jsonl's records (or its bytes, as a checkpoint keeps them)."""
    if isinstance(metrics, bytes):
        metrics = [json.loads(line) for line in metrics.decode("utf-8").split("\n") if line.strip()]
    records = [r for r in metrics if "loss" in r]  # not the out-of-memory event lines
    train = [(r["step"], float(r["loss"])) for r in records]
    evals = [(r["step"], float(r["eval_loss"])) for r in records if r.get("eval_loss") is not None]
    return loss_svg(train, evals)


# loss.svg: train loss per optimizer step and the eval loss, drawn as SVG text at every run's end with the standard
# library only (matplotlib took ~1 s of a 5 s digits run; `check` runs many). `reproduce report` draws the full
# figures with matplotlib.
WIDTH, HEIGHT = 700, 400  # the 7 x 4 inches at 100 dpi the PNG had
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 20, 50  # the plot area's margins
TRAIN, EVAL = "#1f77b4", "#ff7f0e"  # matplotlib's first two colours, as before


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """About `count` round values (1, 2 or 5 x 10^k apart) covering [low, high]."""
    if not high > low:
        low, high = low - 1, high + 1
    raw = (high - low) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(power * f for f in (1, 2, 5, 10) if power * f >= raw)
    first = math.floor(low / step) * step
    ticks = [first + i * step for i in range(int(math.ceil((high - first) / step)) + 1)]
    return [round(t, 12) for t in ticks]


def _paths(points: list[tuple[float, float]], x, y) -> list[str]:
    """SVG path data for the points, broken where a value is not finite (as matplotlib breaks a line at NaN)."""
    runs, current = [], []
    for step, value in points:
        if math.isfinite(value):
            current.append(f"{x(step):.1f},{y(value):.1f}")
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return ["M" + " L".join(run) for run in runs]


def loss_svg(train: list[tuple[float, float]], evals: list[tuple[float, float]]) -> str:
    """The SVG document: (step, loss) of the training steps and of the evaluations."""
    finite = [v for _, v in train + evals if math.isfinite(v)]
    steps = [s for s, _ in train + evals] or [0, 1]
    xs = nice_ticks(min(steps), max(steps))
    ys = nice_ticks(min(finite, default=0.0), max(finite, default=1.0))
    width, height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + (step - xs[0]) / (xs[-1] - xs[0]) * width

    def y(value: float) -> float:
        return TOP + (ys[-1] - value) / (ys[-1] - ys[0]) * height

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="DejaVu Sans, Arial, sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<rect x="{LEFT}" y="{TOP}" width="{width}" height="{height}" fill="none" stroke="black"/>']
    for tick in xs:
        out.append(f'<line x1="{x(tick):.1f}" y1="{TOP + height}" x2="{x(tick):.1f}" y2="{TOP + height + 5}" '
                   f'stroke="black"/><text x="{x(tick):.1f}" y="{TOP + height + 18}" text-anchor="middle">'
                   f"{tick:g}</text>")
    for tick in ys:
        out.append(f'<line x1="{LEFT - 5}" y1="{y(tick):.1f}" x2="{LEFT}" y2="{y(tick):.1f}" stroke="black"/>'
                   f'<text x="{LEFT - 8}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick:g}</text>')
    out.append(f'<text x="{LEFT + width / 2}" y="{HEIGHT - 10}" text-anchor="middle">optimizer step</text>')
    out.append(f'<text transform="translate(16 {TOP + height / 2}) rotate(-90)" text-anchor="middle">loss</text>')
    for points, colour in ((train, TRAIN), (evals, EVAL)):
        out += [f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>' for path in _paths(points, x, y)]
    out += [f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="3" fill="{EVAL}"/>' for s, v in evals if math.isfinite(v)]
    legend = [("train loss", TRAIN)] + ([("eval loss", EVAL)] if evals else [])
    for row, (label, colour) in enumerate(legend):
        top = TOP + 16 + 18 * row
        out.append(f'<line x1="{LEFT + width - 120}" y1="{top}" x2="{LEFT + width - 96}" y2="{top}" '
                   f'stroke="{colour}" stroke-width="1.5"/><text x="{LEFT + width - 88}" y="{top + 4}">'
                   f"{escape(label)}</text>")
    out.append("</svg>")
    return "\n".join(out) + "\n"
