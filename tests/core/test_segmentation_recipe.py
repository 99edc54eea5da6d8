"""The recipe schema of task `segmentation`: its data format's fields, ignore_index, classes, and the
reported metrics each task evaluates (an unknown one is an error, never silently ignored)."""

from __future__ import annotations

import pytest

from reproduce.errors import UserError
from reproduce.plan.recipe import REPORTED_METRICS, parse_recipe


def seg_recipe(data: dict | None = None, **extra) -> dict:
    recipe = {
        "batch": {"effective": 16, "devices": 8, "per_device": 2},
        "task": "segmentation",
        "model": {"builtin": "deeplabv3-resnet50"},
        "data": {"format": "segmentation", "available": False, "classes": 21, "crop": 513, "scale": [0.5, 2.0],
                 "pad": True, **(data or {})},
        "optimizer": {"name": "sgd", "lr": 0.007, "momentum": 0.9},
        "schedule": {"decay": {"kind": "polynomial", "power": 0.9}, "total": {"steps": 30000}},
    }
    recipe.update(extra)
    return recipe


def error(recipe: dict) -> str:
    with pytest.raises(UserError) as caught:
        parse_recipe(recipe, source="r.yaml")
    assert len(caught.value.lines) == 1
    return caught.value.lines[0]


def test_a_segmentation_recipe_reads_with_its_defaults():
    recipe = parse_recipe(seg_recipe(reported=[{"metric": "miou", "value": 77.21, "split": "val"},
                                               {"metric": "pixel_accuracy", "value": 95.1}]))
    data = recipe.data
    assert recipe.task == "segmentation" and recipe.ignore_index == 255
    assert data.crop == (513, 513) and data.scale == (0.5, 2.0) and data.flips and data.pads
    assert data.layout is None  # found from the folder
    wide = parse_recipe(seg_recipe({"crop": [512, 1024], "layout": "images-masks", "flip": False, "pad": None,
                                    "ignore_index": 250, "classes": 19}))
    assert wide.data.crop == (512, 1024) and not wide.data.flips and not wide.data.pads and wide.ignore_index == 250


@pytest.mark.parametrize(("data", "extra", "expected"), [
    ({"crop": None}, {}, "data.crop: required for segmentation data"),
    ({"crop": [0, 5]}, {}, "data.crop: height and width must be > 0 (got [0, 5])"),
    ({"scale": [2.0, 0.5]}, {}, "data.scale: expected [low, high] with 0 < low <= high (got [2.0, 0.5])"),
    ({"classes": None}, {}, "data.classes: required for task segmentation"),
    ({"ignore_index": 3}, {}, "data.ignore_index: 3 is one of the 21 class ids 0 .. 20"),
    ({"layout": "coco"}, {}, "data.layout: expected one of 'voc', 'images-masks' or 'cityscapes' (got 'coco')"),
    ({}, {"task": "classification"}, "data.format: segmentation data is for task segmentation (task is "
                                     "classification)"),
])
def test_bad_segmentation_fields_are_one_line(data, extra, expected):
    assert expected in error(seg_recipe(data, **extra))


def test_segmentation_fields_belong_to_their_format_and_task():
    imagefolder = {"format": "imagefolder", "available": False, "classes": 10, "crop": None, "scale": None,
                   "pad": None}
    assert "data.flip: only used with format segmentation (format is imagefolder)" in error(
        seg_recipe({**imagefolder, "flip": True}, task="classification"))
    assert "data.ignore_index: only used with task segmentation (task is classification)" in error(
        seg_recipe({**imagefolder, "ignore_index": 255}, task="classification"))


def test_an_unknown_reported_metric_names_the_metrics_the_task_evaluates():
    line = error(seg_recipe(task="segmentation", reported=[{"metric": "mIoU_percent", "value": 77.2}]))
    assert line == ("r.yaml: reported.0.metric: unknown metric 'mIoU_percent' for task segmentation, which evaluates "
                    f"{', '.join(REPORTED_METRICS['segmentation'])}; a figure the run does not measure (a downstream "
                    "benchmark) says evaluated: false")
    # miou is a segmentation metric: a classification recipe does not evaluate it
    imagefolder = {"format": "imagefolder", "available": False, "classes": 10, "crop": None, "scale": None,
                   "pad": None}
    line = error(seg_recipe(imagefolder, task="classification", reported=[{"metric": "miou", "value": 70.0}]))
    assert "unknown metric 'miou' for task classification, which evaluates val_loss, eval_loss, loss, " in line
    # a downstream figure stays, as documentation
    recipe = parse_recipe(seg_recipe(reported=[{"metric": "coco_ap", "value": 40.0, "evaluated": False}]))
    assert recipe.reported[0].evaluated is False


def test_reported_segmentation_metrics_meet_the_runs():
    from reproduce.plan.reported import compare_reported

    recipe = parse_recipe(seg_recipe(reported=[{"metric": "miou", "value": 77.21, "split": "val"},
                                               {"metric": "pixel_accuracy", "value": 0.95},
                                               {"metric": "fw_iou", "value": 80.0, "evaluated": False}]))
    rows = compare_reported(recipe, {"eval_miou": 0.5, "eval_pixel_accuracy": 0.9}, 10, 30000)
    assert [(row["label"], row["run"], row["paper"]) for row in rows] == [("eval mIoU", 0.5, 0.7721),
                                                                          ("eval pixel accuracy", 0.9, 0.95)]


def test_plan_refuses_an_unknown_built_in_with_the_nearest_name(tmp_path, capsys):
    import yaml

    from core_helpers import cli

    recipe = seg_recipe(model={"builtin": "deeplabv3-resnet5"})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code, out, err = cli(capsys, "plan", path, "--micro-batch-max", "2")
    assert code == 2 and err.strip() == ("error: model.builtin: no built-in 'deeplabv3-resnet5' (did you mean "
                                         "'deeplabv3-resnet50'?); a model of your own is model.factory: "
                                         "'package.module:function'")
