"""Semantic segmentation models from torchvision, randomly initialised (no weights are ever downloaded).

`deeplabv3-resnet50` / `deeplabv3-resnet101` (Chen et al. 2017, arXiv 1706.05587), `fcn-resnet50` (Long et al.
2015, with torchvision's dilated ResNet backbone) and `lraspp-mobilenet-v3-large` (Howard et al. 2019). Each returns
torchvision's dict: `{"out": logits (B, K, H, W)}`, with `"aux"` (the FCN head on ResNet's layer3) when built with
`aux_loss=True`, which a recipe asks for with `model.aux_weight`. The logits are upsampled to the input's size.

kwargs (the recipe's `model.kwargs`, and what `build_model` adds from `model.output_stride` and `model.aux_weight`;
`model.batchnorm` converts the built model's BatchNorm as for every model, models.convert):
- `num_classes` (default: the data's classes, else 21 as Pascal VOC's);
- `output_stride`: 8 or 16 (input size / feature size), set by dilating ResNet's last stages
  (`replace_stride_with_dilation`): [False, True, True] at 8, [False, False, True] at 16. torchvision's builds use
  8; DeepLabV3 trains at 16 and evaluates at 8 (sec. 4.1, "output_stride = 16 ... 8 for evaluation"), where ASPP's
  atrous rates double (6, 12, 18 at 16; 12, 24, 36 at 8, sec. 3.3). LR-ASPP's MobileNetV3 is fixed at 16;
- `aux_loss`: build the auxiliary head (ResNet models; deeplabv3_resnet50 takes no output stride, so the model is
  assembled from `resnet50(replace_stride_with_dilation=...)` as torchvision assembles it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from .architectures import IMAGE_CHANNELS, Architecture

VOC_CLASSES = 21  # Pascal VOC 2012: 20 object classes and the background
DILATION = {8: [False, True, True], 16: [False, False, True]}  # ResNet's layer2..4 dilated instead of strided
ASPP_RATES = {8: (12, 24, 36), 16: (6, 12, 18)}  # Chen et al. 2017 sec. 3.3
KNOWN = ("num_classes", "output_stride", "aux_loss")


@dataclass(frozen=True)
class TorchvisionSegmentation(Architecture):
    """A torchvision segmentation model: `head` "deeplabv3" / "fcn" on a ResNet, or "lraspp" on MobileNetV3."""

    head: str = "deeplabv3"
    backbone: str = "resnet50"
    output_stride: int = 8  # torchvision's own builds
    aux: bool = True  # whether torchvision has an auxiliary head for it

    def model_inputs(self, kwargs: dict) -> dict:
        return {"inputs": "images", "channels": IMAGE_CHANNELS, "classes": kwargs.get("num_classes", VOC_CLASSES),
                "targets": "masks"}

    def settings(self, kwargs: dict, data_info: dict | None = None) -> dict:
        unknown = sorted(set(kwargs) - set(KNOWN))
        if unknown:
            raise UserError(f"model.kwargs: {self.name} has no setting {unknown[0]!r} (it takes {', '.join(KNOWN)})")
        data_info = data_info or {}
        channels = data_info.get("channels")
        if channels is not None and channels != IMAGE_CHANNELS:
            raise UserError(f"data.channels: {self.name} takes {IMAGE_CHANNELS}-channel images (got {channels})")
        declared = data_info.get("classes")
        if kwargs.get("num_classes") and declared and kwargs["num_classes"] != declared:
            raise UserError(f"model.kwargs.num_classes: {kwargs['num_classes']} output channels, but data.classes is "
                            f"{declared}: the model predicts one channel per class (remove num_classes)")
        classes = kwargs.get("num_classes") or declared or VOC_CLASSES
        stride = kwargs.get("output_stride") or self.output_stride
        allowed = (16,) if self.head == "lraspp" else tuple(DILATION)
        if stride not in allowed:
            raise UserError(f"model.output_stride: {self.name} takes {' or '.join(map(str, allowed))} (got {stride})")
        aux = bool(kwargs.get("aux_loss"))
        if aux and not self.aux:
            raise UserError(f"model.aux_weight: {self.name} has no auxiliary head in torchvision (remove aux_weight)")
        return {"classes": int(classes), "stride": int(stride), "aux": aux}

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
        settings = self.settings(kwargs, data_info)
        try:
            from torchvision.models import segmentation
        except (ImportError, RuntimeError) as exc:  # RuntimeError: a torchvision built for another torch
            raise UserError(f"model.builtin: {self.name} needs torchvision, which does not import here: {exc}"
                            ) from None
        if self.head == "lraspp":
            return segmentation.lraspp_mobilenet_v3_large(
                weights=None, weights_backbone=None, num_classes=settings["classes"])
        return self._resnet_model(settings)

    def _resnet_model(self, settings: dict) -> nn.Module:
        """Assembled as torchvision's `_deeplabv3_resnet` / `_fcn_resnet` do, from a ResNet built with the output
        stride's dilation, and ASPP's rates for the output stride."""
        import torchvision
        from torchvision.models._utils import IntermediateLayerGetter
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
        from torchvision.models.segmentation.fcn import FCN, FCNHead

        backbone = getattr(torchvision.models, self.backbone)(
            weights=None, replace_stride_with_dilation=DILATION[settings["stride"]])
        classes, aux = settings["classes"], settings["aux"]
        returned = {"layer4": "out", **({"layer3": "aux"} if aux else {})}
        layers = IntermediateLayerGetter(backbone, return_layers=returned)
        aux_head = FCNHead(1024, classes) if aux else None
        if self.head == "fcn":
            return FCN(layers, FCNHead(2048, classes), aux_head)
        return DeepLabV3(layers, DeepLabHead(2048, classes, atrous_rates=ASPP_RATES[settings["stride"]]), aux_head)


class ClassesDiffer(UserError):
    """A model whose logits are not one channel per class of the data (a UserError: one line, exit 2)."""


PROBE_SIDE = 64  # the side of the image the class check forwards: the channels do not depend on the size


def check_output_classes(model: nn.Module, classes: int, crop: tuple[int, int] | None, name: str) -> None:
    """A segmentation model's logits have one channel per class of the data: else one line now, when the model is
    built (before `run` writes or removes anything), not a traceback at the first evaluation. Found by a forward of
    one image: on the meta device (nothing computed) where the model is there, else of a small zero image in eval
    mode without gradients (its weights, BatchNorm statistics and random state untouched). A model whose forward
    fails on that image is left to the run (its own error then names it)."""
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
    """The main logits of a segmentation model's output (torchvision's dict), or the output itself."""
    return output["out"] if isinstance(output, dict) else output


SEGMENTATION_MODELS: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        # Chen et al. 2017 (arXiv 1706.05587) sec. 3.3: ResNet with atrous convolution in block4 and ASPP (a 1x1 and
        # three 3x3 convolutions at rates 6, 12, 18 for output stride 16, with image-level pooling, 256 filters each,
        # BatchNorm); torchvision's DeepLabHead. The auxiliary FCN head on layer3 is torchvision's (and MMSeg's), not
        # the paper's.
        TorchvisionSegmentation("deeplabv3-resnet50", "DeepLabV3 ResNet-50 (torchvision)"),
        TorchvisionSegmentation("deeplabv3-resnet101", "DeepLabV3 ResNet-101 (torchvision)", backbone="resnet101"),
        TorchvisionSegmentation("fcn-resnet50", "FCN ResNet-50, dilated (torchvision)", head="fcn"),
        # Howard et al. 2019 (arXiv 1905.02244) sec. 6.2: LR-ASPP on MobileNetV3-Large, last block dilated (stride 16).
        TorchvisionSegmentation("lraspp-mobilenet-v3-large", "LR-ASPP MobileNetV3-Large (torchvision)",
                                head="lraspp", backbone="mobilenet_v3_large", output_stride=16, aux=False),
    )
}
