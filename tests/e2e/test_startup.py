"""A short run pays only for what it uses: loss.svg drawn without matplotlib, and `reproduce run` importing neither
the other commands' packages nor typer's help renderer (bench/startup.py measures the whole process)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from reproduce.observe.outputs import BOTTOM, HEIGHT, LEFT, RIGHT, TOP, WIDTH, loss_svg, nice_ticks, plot_metrics

ROOT = Path(__file__).resolve().parents[2]
SVG = "{http://www.w3.org/2000/svg}"


def _points(path: ET.Element) -> list[tuple[float, float]]:
    return [tuple(map(float, p.strip("ML ").split(","))) for p in path.get("d").split(" L")]


@pytest.mark.parametrize("low, high", [(0.0, 2.303), (0.0012, 0.0049), (1, 300), (5.0, 5.0), (-3.5, 12.25)])
def test_the_ticks_are_round_and_cover_the_values(low, high):
    ticks = nice_ticks(low, high)
    assert ticks[0] <= low and ticks[-1] >= high and 3 <= len(ticks) <= 12
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:], strict=False)}
    assert len(steps) == 1
    mantissa = steps.pop() / 10 ** math.floor(math.log10(ticks[1] - ticks[0]))
    assert round(mantissa, 6) in (1, 2, 5)


def test_the_curve_holds_every_step_inside_the_axes_and_breaks_at_a_non_finite_loss():
    train = [(step, 2.3 / step) for step in range(1, 11)]
    train[4] = (5, float("nan"))
    svg = ET.fromstring(loss_svg(train, [(5, 0.9), (10, 0.4)]))
    assert (svg.get("width"), svg.get("height")) == (str(WIDTH), str(HEIGHT))
    paths = svg.findall(f"{SVG}path")
    train_paths, eval_paths = paths[:2], paths[2:]
    assert [len(_points(p)) for p in train_paths] == [4, 5]  # steps 1-4 and 6-10: the NaN step is a gap
    assert len(eval_paths) == 1 and len(svg.findall(f"{SVG}circle")) == 2
    for path in paths:
        for x, y in _points(path):
            assert LEFT <= x <= WIDTH - RIGHT and TOP <= y <= HEIGHT - BOTTOM
    ys = {round(y, 1) for x, y in _points(train_paths[0])}
    assert len(ys) == 4  # a falling loss: each step its own height
    first, second = _points(train_paths[0])[:2]
    assert second[0] > first[0] and second[1] > first[1]  # later to the right, lower loss lower (SVG y down)
    texts = [t.text for t in svg.iter(f"{SVG}text")]
    assert {"optimizer step", "loss", "train loss", "eval loss"} <= set(texts)


def test_plot_metrics_reads_metrics_jsonl_and_skips_event_lines(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    records = [{"step": 1, "loss": 2.0}, {"event": "out_of_memory", "step": 2}, {"step": 2, "loss": 1.5},
               {"step": 3, "loss": 1.0, "eval_loss": 1.2}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    written = plot_metrics(metrics, tmp_path / "loss.svg")
    assert written == str(tmp_path / "loss.svg")
    svg = ET.parse(written).getroot()
    paths = svg.findall(f"{SVG}path")
    assert [len(_points(p)) for p in paths] == [3, 1]
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_short_run_imports_no_matplotlib_no_help_renderer_and_no_other_command(tmp_path):
    # `python -m reproduce run ...` as a user starts it; at its exit (after the command's own exit handlers) the
    # modules it loaded, and whether its objects were left to the OS (cli.leave_to_the_os) rather than collected
    code = ("import atexit, gc, json, runpy, sys\n"
            "report = lambda: print(json.dumps([sorted(sys.modules), gc.get_freeze_count()]), file=sys.stderr)\n"
            "atexit.register(report)\n"
            "sys.argv[0] = 'reproduce'\n"
            "runpy.run_module('reproduce', run_name='__main__', alter_sys=True)\n")
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", code, "run", "papers/digits-mlp.yaml", "--micro-batch-max", "32",
                           "--max-steps", "2", "--device", "cpu", "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
                                          "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    modules, frozen = json.loads(done.stderr.splitlines()[-1])
    assert "torch" in modules and "reproduce.train.trainer" in modules  # (it did train)
    unused = {"matplotlib", "typer.rich_utils", "pygments", "reproduce.check", "reproduce.report"}
    assert not unused & set(modules)
    assert frozen > 100_000  # torch's objects, left to the OS at exit
    assert done.stdout.rstrip().endswith(str(out / "loss.svg"))  # the last line printed, flushed
    assert json.loads((out / "summary.json").read_text())["plot"] == str(out / "loss.svg")
    assert ET.parse(out / "loss.svg").getroot().tag == f"{SVG}svg"


@pytest.mark.parametrize("argv, registered", [(["--version"], False), (None, True)])
def test_only_the_process_entry_leaves_its_objects_to_the_os(argv, registered, monkeypatch):
    import reproduce.cli as cli

    handlers = []
    monkeypatch.setattr(cli.atexit, "register", handlers.append)
    monkeypatch.setattr(sys, "argv", ["reproduce", "--version"])
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    assert (cli.leave_to_the_os in handlers) is registered  # main(argv) from tests or a program: left alone
