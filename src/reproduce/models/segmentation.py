"""The segmentation built-ins (architectures.SEGMENTATION_MODELS): DeepLabV3 (Chen et al. 2017, arXiv 1706.05587),
FCN (Long et al. 2015) and LR-ASPP (Howard et al. 2019) from torchvision. Each returns `{"out": logits (B, K, H,
W)}`, with `"aux"` (the FCN head on layer3) for `model.aux_weight`.

`model.output_stride` 8 or 16 dilates ResNet's last stages (DeepLabV3 trains at 16, evaluates at 8: sec. 4.1).

`model.backbone_weights`: an ImageNet backbone file (torchvision's, timm's or MMSegmentation's names) loaded strictly
into the backbone, else one line saying what the file is and what fits; the heads stay at their initialisation.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..plan.recipe import Recipe
from ..plan.weightfiles import inspect
from .architectures import SEGMENTATION_MODELS
from .pretrained import read_state_dict
from .weights import SHOWN, on_meta, shown


class ClassesDiffer(UserError):
    """A model whose logits are not one channel per class of the data."""


PROBE_SIDE = 64  # the side of the image the class check forwards: the channels do not depend on the size


def check_output_classes(model: nn.Module, classes: int, crop: tuple[int, int] | None, name: str) -> None:
    """One line when the logits of one image's forward (on meta, or small, eval, no grad) are not a channel a class."""
    parameter = next(iter(model.parameters()), None)
    if parameter is None:
        return
    height, width = crop or (PROBE_SIDE, PROBE_SIDE)
    if parameter.device.type != "meta":
        height, width = min(height, PROBE_SIDE), min(width, PROBE_SIDE)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            image = torch.zeros(1, 3, height, width, device=parameter.device, dtype=parameter.dtype)
            logits = output_of(model(image))
    except Exception:  # a size or device the user's model does not take here: the run's forward says what fails
        return
    finally:
        model.train(was_training)
    channels = logits.shape[1] if getattr(logits, "ndim", 0) == 4 else None
    if channels != classes:
        got = (f"{channels} output channels" if channels is not None
               else f"output of shape {list(getattr(logits, 'shape', []))} (expected batch x classes x H x W)")
        raise ClassesDiffer(f"model: {name} gives {got} on data of {classes} classes (data.classes): its logits need "
                            f"one channel per class; build it with {classes} outputs")


def output_of(output: Any) -> Any:
    return output["out"] if isinstance(output, dict) else output


# ---- model.backbone_weights -----------------------------------------------------------------------------------------

FIELD = "model.backbone_weights"
COUNTER = "num_batches_tracked"
# (blocks per stage, bottleneck blocks) -> depth (He et al. 2016, Table 1)
RESNET_DEPTHS = {((2, 2, 2, 2), False): 18, ((3, 4, 6, 3), False): 34, ((3, 4, 6, 3), True): 50,
                 ((3, 4, 23, 3), True): 101, ((3, 8, 36, 3), True): 152}
# what fits each built-in's backbone, named in the refusal (torchvision's ImageNet weights: its model builders' docs)
FITS = {
    "resnet50": "a torchvision ResNet-50 ImageNet state dict (ResNet50_Weights.IMAGENET1K_V1: resnet50-0676ba61.pth), "
                "timm's resnet50, or an MMPretrain ResNet-50 (ResNetV1b, resnet50_8xb32_in1k)",
    "resnet101": "a torchvision ResNet-101 ImageNet state dict (ResNet101_Weights.IMAGENET1K_V1: "
                 "resnet101-63fe2227.pth), timm's resnet101, or an MMPretrain ResNet-101 (ResNetV1b)",
    "mobilenet_v3_large": "a torchvision MobileNetV3-Large ImageNet state dict (MobileNet_V3_Large_Weights."
                          "IMAGENET1K_V1: mobilenet_v3_large-8738ca79.pth)",
}


def load_backbone(model: nn.Module, recipe: Recipe) -> None:
    """The backbone file into `model.backbone`, checked strictly against it (on meta only checked); the run's line is
    `model.backbone_report`."""
    path = recipe.model.backbone_weights
    name = recipe.model.builtin or "the model"
    weights = inspect(path, FIELD)
    if weights.is_folder:
        raise UserError(f"{FIELD}: {path}: a Hugging Face folder; expected one state dict file of the backbone "
                        "(.pth, .pt, .safetensors)")
    backbone = getattr(model, "backbone", None)
    if not isinstance(backbone, nn.Module):
        raise UserError(f"{FIELD}: {name} has no `backbone` module to load it into (the segmentation built-ins do)")
    found = read_state_dict(weights, shapes_only=True, field=FIELD)
    keys = _backbone_keys(found, backbone)
    expected = {key: value.shape for key, value in backbone.state_dict(keep_vars=True).items()}
    missing = [key for key in expected if key not in keys and not key.endswith(COUNTER)]
    other = [key for key in expected if key in keys and tuple(found[keys[key]]) != tuple(expected[key])]
    extra = _extra(found, keys, backbone)
    if missing or other or extra:  # what the file is, what does not fit, what would
        built = getattr(SEGMENTATION_MODELS.get(recipe.model.builtin or ""), "backbone", "")
        shapes = "; ".join(f"{key}: file {list(found[keys[key]])}, model {list(expected[key])}"
                           for key in other[:SHOWN])
        detail = ", ".join(part for part in (
            f"{len(missing)} of its backbone's tensors missing ({shown(missing)})" if missing else "",
            f"{len(other)} of another shape ({shapes})" if other else "",
            f"{len(extra)} of the file's with no place in it ({shown(extra)})" if extra else "") if part)
        what = describe(list(found))
        other_builtin = next((builtin for depth, builtin in (("ResNet-50", "deeplabv3-resnet50 or fcn-resnet50"),
                                                              ("ResNet-101", "deeplabv3-resnet101"))
                              if what.startswith(f"a {depth} ") and built != depth.lower().replace("-", "")), None)
        takes = f"; the built-in that takes it: {other_builtin}" if other_builtin else ""
        fits = FITS.get(built, "a state dict of its backbone's names")
        raise UserError(f"{FIELD}: {path}: {what}, which does not fit {name}'s backbone, torchvision's "
                        f"{built.replace('_', ' ')} ({detail}); what fits: {fits}{takes}")
    state = found if on_meta() else read_state_dict(weights, shapes_only=False, field=FIELD)
    used = {keys[key] for key in expected if key in keys}
    left = {head: count for head, module in model.named_children()  # the heads, left at their initialisation
            if module is not backbone and (count := len(module.state_dict()))}
    unused = [key for key in found if key not in used]
    loaded = {key: state[keys[key]] for key in expected if key in keys}
    heads = ", ".join(f"{module} ({count})" for module, count in left.items()) or "nothing"
    files = (f"{len(unused)} of the file's tensors not used ({shown(unused)})" if unused
             else "every tensor of the file used")
    model.backbone_report = (f"backbone: {len(loaded)} tensors from {weights.path} into {name}'s backbone, every "
                             f"one of its weights and statistics; left at their initialisation: {heads}; {files}")
    if not on_meta():
        with torch.no_grad():
            backbone.load_state_dict(loaded, strict=False)  # every tensor checked; counters may be absent


def _backbone_keys(found: dict, backbone: nn.Module) -> dict[str, str]:
    """The backbone's key -> the file's, less a `backbone.` (MMSeg, MMPretrain) or MobileNet's `features.` prefix."""
    names = list(found)
    prefix = "backbone." if any(name.startswith("backbone.") for name in names) else ""
    own = set(backbone.state_dict())
    if prefix == "" and not (own & set(names)) and any(name.startswith("features.") for name in names):
        prefix = "features."
    return {name[len(prefix):]: name for name in names if name.startswith(prefix) and name[len(prefix):] in own}


def _extra(found: dict, keys: dict[str, str], backbone: nn.Module) -> list[str]:
    """The file's tensors in the backbone's modules with no place in it (a deeper ResNet's extra blocks)."""
    used = set(keys.values())
    prefix = next((key[: -len(own)] for own, key in keys.items()), "")
    modules = {name for name, _ in backbone.named_children()}
    return [key for key in found if key not in used and key.startswith(prefix)
            and key[len(prefix):].split(".", 1)[0] in modules]


def describe(names: list[str]) -> str:
    """What a state dict's names say it is: a ResNet of some depth, a deep-stem ResNet, a MobileNet, or its keys."""
    plain = [name[len("backbone."):] if name.startswith("backbone.") else name for name in names]
    depth = _resnet_depth(plain)
    if any(name.startswith("stem.0.") for name in plain):
        return (f"MMSegmentation / MMPretrain's ResNetV1c{depth and f'-{depth}'} (a deep stem of three 3x3 "
                "convolutions, stem.0 .. stem.7, in place of torchvision's one 7x7 conv1)")
    if any(name.startswith("conv1.0.") for name in plain):
        return (f"a deep-stem ResNet{depth and f'-{depth}'} (timm's ResNet-C/D names: conv1.0, conv1.3, conv1.6, "
                "three 3x3 convolutions in place of torchvision's one 7x7 conv1)")
    if depth:
        return f"a ResNet-{depth} (torchvision's names)"
    if any(name.startswith("features.") for name in plain):
        return "a MobileNet-style network (features.*)"
    return f"a state dict of {len(names)} tensors ({shown(names)})"


def _resnet_depth(names: list[str]) -> str:
    """"50" for a ResNet-50's names (its blocks per stage and bottleneck blocks), "" for names of no ResNet."""
    blocks = []
    for stage in range(1, 5):
        indices = {int(m.group(1)) for name in names if (m := re.match(rf"layer{stage}\.(\d+)\.", name))}
        blocks.append(max(indices) + 1 if indices else 0)
    if not all(blocks):
        return ""
    bottleneck = any(".conv3." in name for name in names)
    depth = RESNET_DEPTHS.get((tuple(blocks), bottleneck))
    return str(depth) if depth else f"? ({'-'.join(map(str, blocks))} blocks)"
