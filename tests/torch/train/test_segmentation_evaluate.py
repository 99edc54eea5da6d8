"""`reproduce evaluate RUN_DIR`: a finished run's model.pt evaluated again without training gives
the run's own metrics (mIoU, per-class IoU with n/a, pixel accuracy, eval loss), and its table; a run stage 2 starts
from its stage 1's model.pt under batchnorm frozen."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from helpers import cli
from reproduce.data.samples import write_voc


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    return Path(write_voc(tmp_path_factory.mktemp("scenes") / "voc", train=8, val=3)["path"])


def recipe(voc: Path, batchnorm: str, weights: str | None = None, evaluation: dict | None = None) -> dict:
    model = {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": batchnorm}
    if weights:
        model["weights"] = weights
    return {
        "batch": {"effective": 4},
        "task": "segmentation",
        "model": model,
        "data": {"format": "segmentation", "path": str(voc), "classes": 4, "crop": 32, "pad": True},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "schedule": {"total": {"steps": 2}},
        "evaluation": {"at_end": True, **(evaluation or {})},
    }


def test_evaluate_reproduces_the_runs_metrics_and_stage_2_starts_from_stage_1(voc, tmp_path, capsys):
    stage1 = tmp_path / "stage1.yaml"
    stage1.write_text(yaml.safe_dump(recipe(voc, "keep")))
    code, out, err = cli(capsys, "run", stage1, "--out", tmp_path / "one", "--device", "cpu", "--micro-batch-max",
                         "2", "--workers", "0", "--no-noise-scale")
    assert code == 0, err
    final = json.loads((tmp_path / "one" / "summary.json").read_text())["final"]
    ious = final["eval_class_iou"]
    assert len(ious) == 4 and final["eval_miou"] == pytest.approx(
        sum(i for i in ious if i is not None) / sum(i is not None for i in ious), abs=1e-12)
    code, out, err = cli(capsys, "evaluate", tmp_path / "one", "--device", "cpu", "--workers", "0", "--json")
    assert code == 0, err
    again = json.loads(out)
    for key in ("eval_miou", "eval_pixel_accuracy", "eval_class_iou", "eval_items"):
        assert again[key] == final[key], key
    assert again["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-12)
    code, out, err = cli(capsys, "evaluate", tmp_path / "one", "--device", "cpu", "--workers", "0")
    lines = out.splitlines()
    assert lines[0] == "class  IoU" and len(lines) == 7
    assert lines[5].startswith(f"mIoU {final['eval_miou']:.4f}: the mean over the ")
    # the report's per-class table: the last evaluation's IoU of each class (n/a where it has none) and the mean
    code, out, err = cli(capsys, "report", tmp_path / "one", "--no-plots")
    assert code == 0, err
    markdown = (tmp_path / "one" / "report.md").read_text()
    assert "## IoU per class (last evaluation)" in markdown
    cells = ["n/a" if iou is None else f"{iou:.4f}" for iou in ious]
    for index, cell in enumerate(cells):
        assert f"| {index} | {cell} |" in markdown
    assert f"| mIoU | {final['eval_miou']:.4f} |" in markdown
    # stage 2: batchnorm frozen, from stage 1's model.pt (written under keep), then its own model.pt evaluated again
    stage2 = tmp_path / "stage2.yaml"
    stage2.write_text(yaml.safe_dump(recipe(voc, "frozen", str(tmp_path / "one" / "model.pt"))))
    code, out, err = cli(capsys, "run", stage2, "--out", tmp_path / "two", "--device", "cpu", "--micro-batch-max",
                         "2", "--workers", "0", "--no-noise-scale")
    assert code == 0, err
    final = json.loads((tmp_path / "two" / "summary.json").read_text())["final"]
    code, out, err = cli(capsys, "evaluate", tmp_path / "two", "--device", "cpu", "--workers", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["eval_miou"] == final["eval_miou"]


def test_a_sliding_window_evaluation_is_evaluated_again_the_same(voc, tmp_path, capsys):
    """evaluation.mode slide (MMSeg's windows, 32 x 32 every 16 pixels on 64 .. 88-pixel scenes): the run's metrics,
    and reproduce evaluate's on its model.pt, are one and the same."""
    path = tmp_path / "slide.yaml"
    path.write_text(yaml.safe_dump(recipe(voc, "group", evaluation={"mode": "slide", "crop": 32, "stride": 16})))
    code, out, err = cli(capsys, "run", path, "--out", tmp_path / "run", "--device", "cpu", "--micro-batch-max", "2",
                         "--workers", "0", "--no-noise-scale", "--max-steps", "1")
    assert code == 0, err
    final = json.loads((tmp_path / "run" / "summary.json").read_text())["final"]
    code, out, err = cli(capsys, "evaluate", tmp_path / "run", "--device", "cpu", "--workers", "0", "--json")
    assert code == 0, err
    again = json.loads(out)
    assert (again["eval_miou"], again["eval_class_iou"]) == (final["eval_miou"], final["eval_class_iou"])


def test_evaluate_needs_a_finished_run(tmp_path, capsys):
    code, out, err = cli(capsys, "evaluate", tmp_path, "--device", "cpu")
    assert code == 2 and err.strip() == f"error: RUN_DIR: {tmp_path} has no plan.yaml (the folder of a finished " \
                                        "`reproduce run`)"
