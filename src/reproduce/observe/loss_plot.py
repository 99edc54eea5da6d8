"""The run folder's loss.svg: train loss per optimizer step and the eval loss, drawn as SVG text at every run's end
with the standard library only (matplotlib took ~1 s of a 5 s digits run; `check` runs many). `reproduce report`
draws the full figures with matplotlib.
"""

from __future__ import annotations

import math
from html import escape

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
