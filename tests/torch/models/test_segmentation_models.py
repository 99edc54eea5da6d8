"""torchvision's segmentation models as built-ins: the same weights as torchvision's own builds, the output stride and
auxiliary head the recipe sets, and BatchNorm converted (frozen, group) where `model.batchnorm` says."""

from __future__ import annotations

import re

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models import segmentation
from torchvision.ops.misc import FrozenBatchNorm2d

from reproduce.errors import UserError
from reproduce.models import MODELS, build_model, convert, count_batchnorm, count_parameters
from reproduce.plan import builtin_names
from reproduce.plan.recipe import parse_recipe

# torchvision's published parameter counts (its weights' meta, 21 VOC classes, with the auxiliary head where it has one)
PUBLISHED = {
    "deeplabv3-resnet50": segmentation.DeepLabV3_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1,
    "deeplabv3-resnet101": segmentation.DeepLabV3_ResNet101_Weights.COCO_WITH_VOC_LABELS_V1,
    "fcn-resnet50": segmentation.FCN_ResNet50_Weights.COCO_WITH_VOC_LABELS_V1,
    "lraspp-mobilenet-v3-large": segmentation.LRASPP_MobileNet_V3_Large_Weights.COCO_WITH_VOC_LABELS_V1,
}


def recipe(model: dict, classes: int = 5):
    return parse_recipe({
        "batch": {"effective": 4},
        "task": "classification",
        "model": model,
        "data": {"name": "voc", "available": False, "classes": classes, "image_size": 64, "channels": 3},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "schedule": {"total": {"steps": 1}},
    })


def test_registered_and_the_published_size():
    assert set(PUBLISHED) == set(builtin_names.SEGMENTATION_MODELS) <= set(MODELS)
    for name, weights in PUBLISHED.items():
        with torch.device("meta"):
            model = MODELS[name](aux_loss=name.startswith(("deeplab", "fcn")))
        assert count_parameters(model)[0] == weights.meta["num_params"], name


@pytest.mark.parametrize("name, function", [("deeplabv3-resnet50", "deeplabv3_resnet50"),
                                            ("fcn-resnet50", "fcn_resnet50")])
def test_same_weights_as_torchvisions_build(name, function):
    """At torchvision's output stride (8) the assembly is torchvision's: the same modules, seeded the same."""
    torch.manual_seed(0)
    ours = MODELS[name](aux_loss=True).state_dict()
    torch.manual_seed(0)
    theirs = getattr(segmentation, function)(weights=None, weights_backbone=None, aux_loss=True).state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)


def test_output_stride_16_and_the_auxiliary_head():
    model = build_model(recipe({"builtin": "deeplabv3-resnet50", "output_stride": 16, "aux_weight": 0.4})).eval()
    features = {}
    model.backbone.register_forward_hook(lambda module, inputs, output: features.update(output))
    with torch.no_grad():
        output = model(torch.randn(1, 3, 64, 64))
    assert set(output) == {"out", "aux"}
    assert output["out"].shape == output["aux"].shape == (1, 5, 64, 64)  # classes from the data, upsampled
    assert features["out"].shape[-1] == 64 // 16 and features["aux"].shape[-1] == 64 // 16
    rates = [module[0].dilation for module in model.classifier[0].convs[1:4]]
    assert rates == [(6, 6), (12, 12), (18, 18)]  # Chen et al. 2017 sec. 3.3 at output stride 16
    plain = build_model(recipe({"builtin": "deeplabv3-resnet50"})).eval()
    with torch.no_grad():
        assert set(plain(torch.randn(1, 3, 32, 32))) == {"out"}  # no aux_weight: no auxiliary head


@pytest.mark.parametrize("mode, kind", [("group", nn.GroupNorm), ("frozen", FrozenBatchNorm2d)])
def test_batchnorm_replaced_everywhere(mode, kind):
    model = build_model(recipe({"builtin": "deeplabv3-resnet50", "batchnorm": mode, "aux_weight": 0.4}))
    with torch.device("meta"):
        keep = MODELS["deeplabv3-resnet50"](aux_loss=True)
    assert count_batchnorm(model) == 0
    assert sum(isinstance(m, kind) for m in model.modules()) == count_batchnorm(keep) == 61
    norm = (lambda c: nn.GroupNorm(32, c)) if mode == "group" else FrozenBatchNorm2d
    with torch.device("meta"):  # the backbone is resnet50(norm_layer=...), as torchvision would build it
        resnet = torchvision.models.resnet50(norm_layer=norm, replace_stride_with_dilation=[False, True, True])
    kinds = {name: type(m) for name, m in resnet.named_modules() if not name.startswith(("fc", "avgpool"))}
    assert {name: type(m) for name, m in model.backbone.named_modules() if name} == {k: v for k, v in kinds.items()
                                                                                    if k}
    if mode == "group":
        assert {m.num_groups for m in model.modules() if isinstance(m, nn.GroupNorm)} == {32}
    before = {key: value.clone() for key, value in model.state_dict().items()}
    model.train()
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    assert all(torch.equal(value, before[key]) for key, value in model.state_dict().items())  # no running stats


def test_a_segmentation_state_dict_loads_before_the_batchnorm_choice(tmp_path):
    """model.weights into the architecture as published (its BatchNorm), then model.batchnorm: frozen keeps the
    file's statistics and affine parameters, as for every other model."""
    torch.manual_seed(0)
    published = build_model(recipe({"builtin": "lraspp-mobilenet-v3-large"}))
    with torch.no_grad():
        for module in published.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    torch.save(published.state_dict(), tmp_path / "lraspp.pth")
    frozen = build_model(recipe({"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "frozen",
                                 "weights": str(tmp_path / "lraspp.pth")}))
    pairs = [(a, b) for a, b in zip(published.modules(), frozen.modules(), strict=True)
             if isinstance(a, nn.BatchNorm2d)]
    assert len(pairs) == 47 and all(isinstance(b, FrozenBatchNorm2d) for _, b in pairs)
    assert all(torch.equal(a.running_mean, b.running_mean) and torch.equal(a.running_var, b.running_var)
               and torch.equal(a.weight, b.weight) for a, b in pairs)


def test_frozen_keeps_the_statistics_it_replaces():
    norm = nn.BatchNorm2d(4, eps=1e-3)
    with torch.no_grad():
        norm.running_mean.uniform_()
        norm.running_var.uniform_(1, 2)
        norm.weight.uniform_()
        norm.bias.uniform_()
    model = nn.Sequential(nn.Conv2d(3, 4, 1), norm)
    inputs = torch.randn(2, 3, 5, 5)
    expected = model.eval()(inputs)
    frozen = convert(model, "frozen")
    assert isinstance(frozen[1], FrozenBatchNorm2d)
    torch.testing.assert_close(frozen.train()(inputs), expected)  # in training too: the running statistics


def test_group_norm_on_mobilenet_and_small_models():
    model = build_model(recipe({"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"}))
    groups = {(m.num_groups, m.num_channels) for m in model.modules() if isinstance(m, nn.GroupNorm)}
    assert count_batchnorm(model) == 0 and (8, 24) in groups and (32, 960) in groups  # gcd(32, channels)
    small = build_model(recipe({"builtin": "cnn-bn", "batchnorm": "group"}, classes=10))
    assert count_batchnorm(small) == 0


@pytest.mark.parametrize("model, message", [
    ({"builtin": "lraspp-mobilenet-v3-large", "output_stride": 8}, "lraspp-mobilenet-v3-large takes 16 (got 8)"),
    ({"builtin": "lraspp-mobilenet-v3-large", "aux_weight": 0.4}, "has no auxiliary head in torchvision"),
    ({"builtin": "fcn-resnet50", "kwargs": {"output_strides": 8}}, "has no setting 'output_strides'"),
])
def test_bad_settings(model, message):
    with pytest.raises(UserError, match=re.escape(message)):
        build_model(recipe(model))


def test_batchnorm_momentum_from_the_papers_decay():
    model = build_model(recipe({"builtin": "fcn-resnet50", "batchnorm_momentum": 0.0003}))
    assert {m.momentum for m in model.modules() if isinstance(m, nn.BatchNorm2d)} == {0.0003}


def test_frozen_loads_torchvisions_state_dict_strictly():
    """The hook for `model.weights`: a frozen-BN build takes a torchvision checkpoint's keys as they are (its
    BatchNorm statistics and affine parameters; FrozenBatchNorm2d drops num_batches_tracked), so freezing a
    pretrained model's BatchNorm needs no key mapping."""
    torch.manual_seed(0)
    published = segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=5, aux_loss=True)
    with torch.no_grad():
        for module in published.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(1, 2)
    frozen = build_model(recipe({"builtin": "fcn-resnet50", "batchnorm": "frozen", "aux_weight": 0.4}))
    frozen.load_state_dict(published.state_dict(), strict=True)
    inputs = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(frozen.eval()(inputs)["out"], published.eval()(inputs)["out"])  # eval: no dropout
    assert isinstance(frozen.backbone.bn1, FrozenBatchNorm2d)
    torch.testing.assert_close(frozen.backbone.bn1.running_var, published.backbone.bn1.running_var)


@pytest.mark.parametrize(("model", "message"), [
    ({"builtin": "resnet50", "output_stride": 16}, "model.output_stride: only for the segmentation built-ins"),
    ({"factory": "factories:torchvision_resnet50", "output_stride": 8}, "model.output_stride: only for the"),
    ({"builtin": "resnet50", "aux_weight": 0.4}, "model.aux_weight: resnet50 has no auxiliary head"),
])
def test_segmentation_fields_refused_where_nothing_reads_them(model, message):
    with pytest.raises(UserError, match=re.escape(message)):
        recipe(model)
    recipe({"factory": "factories:torchvision_resnet50", "aux_weight": 0.4})  # its own "aux" output, weighed
    from reproduce.plan import recipe as recipe_module

    assert recipe_module.SEGMENTATION_MODELS == builtin_names.SEGMENTATION_MODELS
