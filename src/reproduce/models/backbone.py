"""`model.backbone_weights` / `--backbone-weights FILE`: an ImageNet-pretrained backbone from a file on this machine,
loaded into a segmentation built-in's backbone, as DeepLabV3 and MMSegmentation's configs start.

The file is a torchvision ResNet-50/101 state dict (`resnet50-0676ba61.pth`, `ResNet50_Weights.IMAGENET1K_V1`'s
file), a timm ResNet (its names are torchvision's), or an MMSegmentation / MMPretrain checkpoint (its `state_dict`,
the backbone's keys under `backbone.`; ResNetV1b's names are torchvision's too). A prefix every key has
(`module.`, `_orig_mod.`) is dropped, and `backbone.` selects the backbone's keys when the file has them.

The load is strict where it matters and says what it did (`report`): every tensor of the backbone must come from
the file with its shape (else one line saying what the file is and what fits: MMSegmentation's ResNetV1c has a deep
stem of three 3x3 convolutions, `stem.0` .. `stem.7`, not torchvision's one 7x7 `conv1`, so no torchvision ResNet
takes it); the model's other tensors (the heads) stay at their initialisation, and the file's other tensors (the
ImageNet classifier `fc`, MMSeg's `decode_head`) are named as not used. `num_batches_tracked` is a counter, not a
weight: a file without it (older checkpoints) leaves the model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from ..plan.recipe import Recipe
from ..plan.weightfiles import inspect

FIELD = "model.backbone_weights"
SHOWN = 3
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


@dataclass(frozen=True)
class BackboneLoad:
    """What a backbone file gives a model: its tensors by the backbone's names, and what is left on either side."""

    state: dict  # the backbone's key -> the file's tensor (its shape only when read for a check)
    left: dict[str, int]  # the model's other top-level modules (the heads) -> their tensors left at initialisation
    unused: list[str]  # the file's keys not loaded (the ImageNet classifier, MMSeg's heads)
    path: str

    def report(self, name: str) -> str:
        left = ", ".join(f"{module} ({count})" for module, count in self.left.items()) or "nothing"
        unused = (f"{len(self.unused)} of the file's tensors not used ({_shown(self.unused)})" if self.unused
                  else "every tensor of the file used")
        return (f"backbone: {len(self.state)} tensors from {self.path} into {name}'s backbone, every one of its "
                f"weights and statistics; left at their initialisation: {left}; {unused}")


def _shown(names: list[str]) -> str:
    return ", ".join(names[:SHOWN]) + (", ..." if len(names) > SHOWN else "")


def read_backbone(model: nn.Module, recipe: Recipe, shapes_only: bool = False) -> BackboneLoad:
    """The file of `model.backbone_weights` matched to `model.backbone` (a torchvision segmentation model's), checked
    strictly: a backbone tensor it lacks, or holds at another shape, is one line saying what the file is."""
    from .pretrained import read_state_dict

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
    if missing or other or extra:
        raise UserError(_does_not_fit(path, name, _built_backbone(recipe), list(found), missing, other, extra, keys,
                                      found, expected))
    state = found if shapes_only else read_state_dict(weights, shapes_only=False, field=FIELD)
    used = {keys[key] for key in expected if key in keys}
    left = {}
    for module_name, module in model.named_children():
        if module is not backbone:
            count = len(module.state_dict())
            if count:
                left[module_name] = count
    return BackboneLoad({key: state[keys[key]] for key in expected if key in keys}, left,
                        [key for key in found if key not in used], str(weights.path))


def _backbone_keys(found: dict, backbone: nn.Module) -> dict[str, str]:
    """The backbone's state dict key -> the file's key holding it: the file's names, with `backbone.` taken off
    where the file keeps the backbone under it (MMSeg, MMPretrain, a torchvision segmentation model), and
    `features.` where the backbone is MobileNet's features (LR-ASPP's)."""
    names = list(found)
    prefix = "backbone." if any(name.startswith("backbone.") for name in names) else ""
    own = set(backbone.state_dict())
    if prefix == "" and not (own & set(names)) and any(name.startswith("features.") for name in names):
        prefix = "features."
    return {name[len(prefix):]: name for name in names if name.startswith(prefix) and name[len(prefix):] in own}


def _extra(found: dict, keys: dict[str, str], backbone: nn.Module) -> list[str]:
    """The file's tensors inside the backbone's own modules that the backbone has no place for (a deeper ResNet's
    extra blocks): the file is of another architecture, not a backbone with a classifier beside it."""
    used = set(keys.values())
    prefix = next((key[: -len(own)] for own, key in keys.items()), "")
    modules = {name for name, _ in backbone.named_children()}
    return [key for key in found if key not in used and key.startswith(prefix)
            and key[len(prefix):].split(".", 1)[0] in modules]


def _built_backbone(recipe: Recipe) -> str:
    from .segmentation import SEGMENTATION_MODELS

    return getattr(SEGMENTATION_MODELS.get(recipe.model.builtin or ""), "backbone", "")


def describe(names: list[str]) -> str:
    """What a state dict's names say it is: a ResNet of some depth (torchvision's / timm's / MMPretrain's names),
    MMSeg's ResNetV1c or timm's deep stem, a MobileNet, or its first keys."""
    plain = [name[len("backbone."):] if name.startswith("backbone.") else name for name in names]
    if any(name.startswith("stem.0.") for name in plain):
        depth = _resnet_depth(plain)
        return (f"MMSegmentation / MMPretrain's ResNetV1c{depth and f'-{depth}'} (a deep stem of three 3x3 "
                "convolutions, stem.0 .. stem.7, in place of torchvision's one 7x7 conv1)")
    if any(name.startswith("conv1.0.") for name in plain):
        depth = _resnet_depth(plain)
        return (f"a deep-stem ResNet{depth and f'-{depth}'} (timm's ResNet-C/D names: conv1.0, conv1.3, conv1.6, "
                "three 3x3 convolutions in place of torchvision's one 7x7 conv1)")
    depth = _resnet_depth(plain)
    if depth:
        return f"a ResNet-{depth} (torchvision's names)"
    if any(name.startswith("features.") for name in plain):
        return "a MobileNet-style network (features.*)"
    return f"a state dict of {len(names)} tensors ({_shown(names)})"


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


def _does_not_fit(path: str, name: str, backbone: str, names: list[str], missing: list[str], other: list[str],
                  extra: list[str], keys: dict, found: dict, expected: dict) -> str:
    fits = FITS.get(backbone, "a state dict of its backbone's names")
    shapes = "; ".join(f"{key}: file {list(found[keys[key]])}, model {list(expected[key])}" for key in other[:SHOWN])
    detail = ", ".join(part for part in (
        f"{len(missing)} of its backbone's tensors missing ({_shown(missing)})" if missing else "",
        f"{len(other)} of another shape ({shapes})" if other else "",
        f"{len(extra)} of the file's with no place in it ({_shown(extra)})" if extra else "") if part)
    what = describe(names)
    other_builtin = next((builtin for depth, builtin in (("ResNet-50", "deeplabv3-resnet50 or fcn-resnet50"),
                                                          ("ResNet-101", "deeplabv3-resnet101"))
                          if what.startswith(f"a {depth} ") and backbone != depth.lower().replace("-", "")), None)
    takes = f"; the built-in that takes it: {other_builtin}" if other_builtin else ""
    return (f"{FIELD}: {path}: {what}, which does not fit {name}'s backbone, torchvision's "
            f"{backbone.replace('_', ' ')} ({detail}); what fits: {fits}{takes}")


def load_backbone(model: nn.Module, recipe: Recipe) -> BackboneLoad:
    """The backbone file loaded into `model.backbone` (on the meta device only checked)."""
    from .pretrained import on_meta

    loaded = read_backbone(model, recipe, shapes_only=on_meta())
    if not on_meta():
        with torch.no_grad():
            model.backbone.load_state_dict(loaded.state, strict=False)  # every tensor checked; counters may be absent
    return loaded


def backbone_report(recipe: Recipe, data_info: dict | None) -> str | None:
    """The run's line about its backbone file, read on the meta device (shapes only); None without one."""
    if recipe.model.backbone_weights is None:
        return None
    from . import architecture

    with torch.device("meta"):
        model = architecture(recipe, None, data_info)
    return read_backbone(model, recipe, shapes_only=True).report(recipe.model.builtin or "the model")
