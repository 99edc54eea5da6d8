"""Segmentation as the papers trained it: the classes checked when the model is built (before anything is
written), the tool's own model.pt of a frozen / group run loaded again, and an ImageNet backbone from a local file
(torchvision's, MMSegmentation's and timm's names; ResNetV1c and a deeper ResNet refused, naming what fits).
The backbone files are made here: a torchvision ResNet's random-init state dict, saved as each library saves it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torchvision
import yaml
from safetensors.torch import save_file

from helpers import cli, snapshot
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe


def seg_recipe(model: dict, classes: int = 4, **extra) -> dict:
    return {
        "batch": {"effective": 4},
        "task": "segmentation",
        "model": model,
        "data": {"format": "segmentation", "available": False, "train_size": 8, "classes": classes, "crop": 32,
                 "pad": True},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "schedule": {"total": {"steps": 1}},
        **extra,
    }


# ---- item 3: the classes, when the model is built ----------------------------------------------------------------


def test_a_num_classes_kwarg_that_disagrees_is_one_line_in_the_recipe():
    with pytest.raises(UserError) as caught:
        parse_recipe(seg_recipe({"builtin": "lraspp-mobilenet-v3-large", "kwargs": {"num_classes": 21}}),
                     source="r.yaml")
    assert caught.value.lines == ["r.yaml: model.kwargs.num_classes: 21 output channels, but data.classes is 4: the "
                                  "model predicts one channel per class (remove num_classes: it follows data.classes)"]


FACTORY = '''
from torchvision.models import segmentation


def voc_model():
    return segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=21)


def four_classes():
    return segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=4)
'''


@pytest.fixture
def factory(tmp_path, monkeypatch) -> str:
    (tmp_path / "segfactory41.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "segfactory41"
    sys.modules.pop("segfactory41", None)


def test_a_factory_of_21_outputs_on_4_classes_is_refused_when_built(factory):
    line = ("model: segfactory41:voc_model gives 21 output channels on data of 4 classes (data.classes): its logits "
            "need one channel per class; build it with 4 outputs")
    for device in ("meta", "cpu"):  # the probe's and plan's build, and the run's
        with torch.device(device), pytest.raises(UserError) as caught:
            build_model(parse_recipe(seg_recipe({"factory": f"{factory}:voc_model"})))
        assert caught.value.lines == [line]
    model = build_model(parse_recipe(seg_recipe({"factory": f"{factory}:four_classes"})))
    assert model.training  # the check's forward ran in eval mode and gave the mode back


def test_the_class_mismatch_leaves_the_previous_run_intact(factory, tmp_path, capsys):
    """plan, verify and run --force: one line, exit 2, the previous run's files untouched."""
    recipe = seg_recipe({"factory": f"{factory}:voc_model"})
    recipe["data"].update(available=True, path=str(tmp_path / "data"))
    from reproduce.data.samples import write_voc

    write_voc(tmp_path / "data", train=4, val=2)
    del recipe["data"]["train_size"]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    previous = tmp_path / "out"
    (previous / "checkpoints").mkdir(parents=True)
    for name in ("plan.yaml", "metrics.jsonl", "model.pt", "summary.json", "checkpoints/last.pt"):
        (previous / name).write_text(f"the previous run's {name}\n")
    before = snapshot(tmp_path)
    for argv in (("plan", path), ("verify", path),
                 ("run", path, "--out", previous, "--force", "--device", "cpu")):
        code, out, err = cli(capsys, *argv, "--micro-batch-max", "2")
        assert code == 2, (argv, out, err)
        assert err.strip().splitlines() == ["error: model: segfactory41:voc_model gives 21 output channels on data "
                                            "of 4 classes (data.classes): its logits need one channel per class; "
                                            "build it with 4 outputs"], err
    assert snapshot(tmp_path) == before


# ---- item 2: the tool's own model.pt loads again ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["frozen", "group"])
def test_a_model_pt_written_under_frozen_or_group_loads_with_the_same_setting(mode, tmp_path):
    """A run's model.pt is the converted model's state dict (FrozenBatchNorm2d keeps no num_batches_tracked,
    GroupNorm no running statistics): loaded after the same conversion, every tensor as saved."""
    model = {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": mode}
    torch.manual_seed(3)
    trained = build_model(parse_recipe(seg_recipe(model)))
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter))  # not what a fresh build gives
    saved = trained.state_dict()
    torch.save(saved, tmp_path / "model.pt")
    loaded = build_model(parse_recipe(seg_recipe({**model, "weights": str(tmp_path / "model.pt")}))).state_dict()
    assert list(loaded) == list(saved) and all(torch.equal(loaded[key], saved[key]) for key in saved)
    # under another setting the file is refused, one line naming the architecture as published
    other = "group" if mode == "frozen" else "frozen"
    with pytest.raises(UserError) as caught:
        build_model(parse_recipe(seg_recipe({**model, "batchnorm": other, "weights": str(tmp_path / "model.pt")})))
    assert len(caught.value.lines) == 1 and "its keys do not match lraspp-mobilenet-v3-large's" in caught.value.lines[0]


# ---- item 1: an ImageNet backbone from a local file ---------------------------------------------------------------


@pytest.fixture(scope="module")
def backbones(tmp_path_factory) -> dict[str, Path]:
    """A torchvision ResNet-50's random-init state dict saved as torchvision, MMSegmentation (a checkpoint's
    state_dict, backbone. prefixes, a decode head) and timm (safetensors of torchvision's names) keep it; MMSeg's
    ResNetV1c (deep stem) and a ResNet-101."""
    folder = tmp_path_factory.mktemp("backbones")
    torch.manual_seed(41)
    state = torchvision.models.resnet50(weights=None).state_dict()
    files = {name: folder / name for name in ("resnet50.pth", "mmseg.pth", "timm.safetensors", "v1c.pth",
                                              "resnet101.pth")}
    torch.save(state, files["resnet50.pth"])
    heads = {"decode_head.conv_seg.weight": torch.zeros(19, 512, 1, 1), "decode_head.conv_seg.bias": torch.zeros(19)}
    torch.save({"meta": {"mmseg_version": "1.2.2", "iter": 40000},
                "state_dict": {**{f"backbone.{k}": v for k, v in state.items() if not k.startswith("fc.")}, **heads}},
               files["mmseg.pth"])
    save_file({k: v.contiguous() for k, v in state.items()}, str(files["timm.safetensors"]))
    stem = {"stem.0.weight": (32, 3, 3, 3), "stem.1.weight": (32,), "stem.3.weight": (32, 32, 3, 3),
            "stem.4.weight": (32,), "stem.6.weight": (64, 32, 3, 3), "stem.7.weight": (64,)}
    v1c = {k: v for k, v in state.items() if not k.startswith(("conv1.", "bn1.", "fc."))}
    torch.save({"state_dict": {**v1c, **{k: torch.zeros(shape) for k, shape in stem.items()}}}, files["v1c.pth"])
    with torch.device("meta"):  # a file refused by its names and shapes: each tensor one stored zero, expanded
        deeper = {key: value.shape for key, value in torchvision.models.resnet101(weights=None).state_dict().items()}
    torch.save({key: torch.zeros((), dtype=torch.float16).expand(shape) for key, shape in deeper.items()},
               files["resnet101.pth"])
    return {"state": state, **files}


def deeplab(file: Path | None, batchnorm: str = "keep", builtin: str = "deeplabv3-resnet50"):
    model = {"builtin": builtin, "output_stride": 16, "batchnorm": batchnorm, "aux_weight": 0.4}
    if file is not None:
        model["backbone_weights"] = str(file)
    return parse_recipe(seg_recipe(model, classes=4))


@pytest.mark.parametrize("name, unused", [("resnet50.pth", "fc.weight, fc.bias"),
                                          ("mmseg.pth", "decode_head.conv_seg.weight, decode_head.conv_seg.bias"),
                                          ("timm.safetensors", "fc.bias, fc.weight")])
def test_a_resnet50_backbone_file_goes_into_the_backbone_with_a_report(backbones, name, unused):
    recipe = deeplab(backbones[name])
    torch.manual_seed(0)
    model = build_model(recipe)
    state, backbone = backbones["state"], model.backbone.state_dict()
    assert all(torch.equal(backbone[key], state[key]) for key in backbone)  # every tensor, statistics included
    torch.manual_seed(0)
    fresh = build_model(deeplab(None)).state_dict()
    heads = [key for key in fresh if not key.startswith("backbone.")]
    assert heads and all(torch.equal(model.state_dict()[key], fresh[key]) for key in heads)  # left as initialised
    assert model.backbone_report == (
        f"backbone: 318 tensors from {backbones[name]} into deeplabv3-resnet50's backbone, every one of its weights "
        f"and statistics; left at their initialisation: classifier (44), aux_classifier (8); 2 of the file's "
        f"tensors not used ({unused})")


def test_frozen_batchnorm_takes_the_backbone_files_statistics(backbones):
    model = build_model(deeplab(backbones["resnet50.pth"], "frozen"))
    frozen = model.backbone.layer1[0].bn1
    assert type(frozen).__name__ == "FrozenBatchNorm2d"
    assert torch.equal(frozen.running_var, backbones["state"]["layer1.0.bn1.running_var"])


def test_a_backbone_file_of_another_architecture_is_one_line_naming_what_fits(backbones):
    with pytest.raises(UserError) as caught:
        build_model(deeplab(backbones["v1c.pth"]))
    line, = caught.value.lines
    assert line.startswith(f"model.backbone_weights: {backbones['v1c.pth']}: MMSegmentation / MMPretrain's "
                           "ResNetV1c-50 (a deep stem of three 3x3 convolutions, stem.0 .. stem.7, in place of "
                           "torchvision's one 7x7 conv1), which does not fit deeplabv3-resnet50's backbone, "
                           "torchvision's resnet50 (5 of its backbone's tensors missing (conv1.weight, bn1.weight, "
                           "bn1.bias, ...)); what fits: a torchvision ResNet-50 ImageNet state dict"), line
    with torch.device("meta"), pytest.raises(UserError) as caught:  # the probe's build refuses it as well
        build_model(deeplab(backbones["resnet101.pth"]))
    line, = caught.value.lines
    assert "a ResNet-101 (torchvision's names), which does not fit deeplabv3-resnet50's backbone" in line
    assert "306 of the file's with no place in it (layer3.6.conv1.weight" in line
    assert line.endswith("; the built-in that takes it: deeplabv3-resnet101")


def test_backbone_weights_belong_to_the_segmentation_built_ins():
    with pytest.raises(UserError) as caught:
        parse_recipe(seg_recipe({"builtin": "deeplabv3-resnet50", "backbone_weights": "a.pth", "weights": "b.pt"}))
    assert "backbone_weights: give one of weights" in caught.value.lines[0]


def test_a_paper_recipe_without_its_backbone_file_warns():
    from reproduce.plan.planner import make_plan

    model = {"builtin": "deeplabv3-resnet50", "pretrained": "ResNet-50, ImageNet"}
    warnings = make_plan(parse_recipe(seg_recipe(model)), micro_batch_max=2).warnings
    assert ("this run starts from random weights; the paper started from ResNet-50, ImageNet and its numbers assume "
            "it: give --backbone-weights FILE for an ImageNet backbone, or --weights FILE for a whole model (a run's "
            "model.pt) (docs/segmentation.md)") in warnings
    backed = parse_recipe(seg_recipe({**model, "backbone_weights": "resnet50.pth"}))
    given = make_plan(backed, micro_batch_max=2).warnings
    assert not any("starts from random weights" in line for line in given)


def test_plan_takes_backbone_weights_and_refuses_a_missing_file(backbones, tmp_path, capsys):
    root = Path(__file__).resolve().parents[3]
    recipe = root / "papers" / "chen2017-deeplabv3.yaml"
    code, out, err = cli(capsys, "plan", recipe, "--micro-batch-max", "2")
    assert code == 0 and "this run starts from random weights; the paper started from an ImageNet-pretrained " \
                         "ResNet-101" in err, err
    code, out, err = cli(capsys, "plan", recipe, "--micro-batch-max", "2", "--backbone-weights",
                         backbones["resnet101.pth"])
    assert code == 0 and "starts from random weights" not in err, err
    code, out, err = cli(capsys, "plan", recipe, "--micro-batch-max", "2", "--backbone-weights", tmp_path / "no.pth")
    assert code == 2 and err.strip().splitlines() == [
        f"error: --backbone-weights: {tmp_path / 'no.pth'}: no such file or folder (expected a Hugging Face model "
        "folder or a state dict file: .safetensors, .pt, .pth, .bin); weights are read from this machine only"], err
