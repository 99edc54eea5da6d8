"""Evaluation as MMSegmentation configures it: `evaluation.mode: slide` (windows of a crop every
stride pixels, the overlapping logits averaged) and `evaluation.output_stride` (the trained weights evaluated at
another output stride: DeepLabV3 trains at 16, evaluates at 8)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reproduce.data import Datasets
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe
from reproduce.train.evaluation import model_at_stride, slide_logits


def seg_recipe(model: dict, evaluation: dict | None = None, **data) -> dict:
    return {
        "batch": {"effective": 4},
        "task": "segmentation",
        "model": model,
        "data": {"format": "segmentation", "available": False, "train_size": 8, "classes": 4, "crop": 32,
                 "pad": True, **data},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "schedule": {"total": {"steps": 1}},
        "evaluation": evaluation or {},
    }


def test_slide_averages_the_windows_as_mmsegmentation():
    """A 40 x 50 image in 32 x 32 windows every 16 pixels: rows at 0 and 8 (the last moved back to the edge),
    columns at 0, 16 and 18; each pixel's logits the mean of the windows over it (1 to 6 of them). One window as
    large as the image is the whole image's forward."""
    torch.manual_seed(0)
    model = build_model(parse_recipe(seg_recipe({"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"})))
    model = model.eval().double()
    image = torch.randn(1, 3, 40, 50, dtype=torch.float64)
    with torch.no_grad():
        slid = slide_logits(model, image, (32, 32), (16, 16))["out"]
        total, covered = torch.zeros(1, 4, 40, 50, dtype=torch.float64), torch.zeros(1, 1, 40, 50)
        for top in (0, 8):
            for left in (0, 16, 18):
                total[..., top:top + 32, left:left + 32] += model(image[..., top:top + 32, left:left + 32])["out"]
                covered[..., top:top + 32, left:left + 32] += 1
        assert (int(covered.min()), int(covered.max())) == (1, 6)
        torch.testing.assert_close(slid, total / covered, rtol=0, atol=0)
        torch.testing.assert_close(slide_logits(model, image, (40, 50), (8, 8))["out"], model(image)["out"],
                                   rtol=0, atol=0)


def test_a_model_trained_at_16_evaluates_at_8_with_its_own_weights():
    recipe = parse_recipe(seg_recipe({"builtin": "deeplabv3-resnet50", "output_stride": 16},
                                     {"output_stride": 8}))
    torch.manual_seed(0)
    trained = build_model(recipe)
    setup = SimpleNamespace(plan=SimpleNamespace(recipe=recipe), unwrapped_model=trained.eval(),
                            device=torch.device("cpu"), dtype=torch.float32, data=Datasets([]))
    state = torch.get_rng_state()
    at8 = model_at_stride(setup, 8)
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream untouched
    ours, theirs = at8.state_dict(), trained.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not at8.training
    # ResNet's last stages dilated for 8 (layer3 no longer strided), ASPP's rates doubled (Chen et al. sec. 3.3)
    assert at8.backbone.layer3[0].conv2.stride == (1, 1) and trained.backbone.layer3[0].conv2.stride == (2, 2)
    assert at8.backbone.layer4[1].conv2.dilation == (4, 4) and trained.backbone.layer4[1].conv2.dilation == (2, 2)
    assert at8.classifier[0].convs[1][0].dilation == (12, 12) and trained.classifier[0].convs[1][0].dilation == (6, 6)
    image = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert at8(image)["out"].shape == trained(image)["out"].shape == (1, 4, 64, 64)


@pytest.mark.parametrize("evaluation, task, expected", [
    ({"mode": "slide"}, "segmentation", "evaluation.mode: slide needs crop and stride"),
    ({"crop": 32, "stride": 16}, "segmentation", "evaluation: crop, stride: only used with mode: slide"),
    ({"output_stride": 8}, "classification", "evaluation.mode, output_stride: only used with task segmentation"),
    ({"output_stride": 8}, "lraspp", "evaluation.output_stride: lraspp-mobilenet-v3-large is built at 16 only"),
])
def test_bad_evaluation_fields_are_one_line(evaluation, task, expected):
    recipe = seg_recipe({"builtin": "deeplabv3-resnet50"}, evaluation)
    if task == "lraspp":
        recipe["model"] = {"builtin": "lraspp-mobilenet-v3-large"}
    elif task != "segmentation":
        recipe.update(task=task, data={"name": "x", "available": False, "train_size": 8, "classes": 4})
    with pytest.raises(UserError) as caught:
        parse_recipe(recipe, source="r.yaml")
    assert len(caught.value.lines) == 1 and expected in caught.value.lines[0], caught.value.lines


def test_slide_with_a_window_larger_than_the_images_and_no_padding_is_one_line(tmp_path):
    from reproduce.data import build_data
    from reproduce.data.samples import write_voc

    root = Path(write_voc(tmp_path / "voc", train=4, val=2)["path"])
    recipe = seg_recipe({"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"},
                        {"mode": "slide", "crop": 512, "stride": 341}, path=str(root), pad=None)
    del recipe["data"]["available"], recipe["data"]["train_size"]
    with pytest.raises(UserError) as caught:
        build_data(parse_recipe(recipe))
    line, = caught.value.lines
    assert "is smaller than evaluation.crop 512 x 512 (width x height, mode slide); give a smaller evaluation.crop, " \
           "or data.pad: true" in line and line.startswith(str(root / "JPEGImages"))
