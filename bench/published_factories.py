"""The models and data of published memory measurements, for bench/published_memory.py (random weights, data made here).

Hugging Face's "Model training anatomy" / "efficient training on one GPU" pages: google-bert/bert-large-uncased with
a sequence-classification head (AutoModelForSequenceClassification: 2 labels), dummy data of 512 sequences of 512
token ids drawn from [100, 30000) with labels 0/1, trained by the Trainer's defaults (fp32, AdamW, clipping at 1.0).
"""

from __future__ import annotations

import torch


def bert_large_classifier(attention: str = "eager") -> torch.nn.Module:
    """bert-large-uncased's architecture (its config.json's figures), a 2-label classifier, as transformers builds it.
    `attention`: "eager" as transformers ran BERT when the page was measured (January 2022: scores, softmax and the
    attention dropout's mask materialised, B x 16 x 512 x 512 each); "sdpa" as transformers 5 runs it."""
    import transformers

    config = transformers.BertConfig(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096, max_position_embeddings=512, type_vocab_size=2,
                                     num_labels=2)
    config._attn_implementation = attention
    return transformers.BertForSequenceClassification(config)


def dummy_tokens(items: int = 512, length: int = 512, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(100, 30000, (items, length), generator=generator)
    labels = torch.randint(0, 2, (items,), generator=generator)
    return {"train": torch.utils.data.TensorDataset(tokens, labels), "info": {"name": "dummy tokens (HF docs)"}}


def _conv_module(inputs: int, outputs: int, kernel: int, dilation: int = 1) -> torch.nn.Sequential:
    """mmcv's ConvModule as MMSeg's heads use it: a convolution without bias, BatchNorm, ReLU."""
    from torch import nn

    padding = 0 if kernel == 1 else dilation
    return nn.Sequential(nn.Conv2d(inputs, outputs, kernel, padding=padding, dilation=dilation, bias=False),
                         nn.BatchNorm2d(outputs), nn.ReLU(inplace=True))


class MMSegASPPHead(torch.nn.Module):
    """MMSeg's ASPPHead (mmseg/models/decode_heads/aspp_head.py) with the R-50-D8 config's figures: image pooling and
    four branches (1x1, and 3x3 at dilations 12, 24, 36) of 512 channels each, concatenated (2560 channels), a 3x3
    bottleneck ConvModule to 512, then BaseDecodeHead's cls_seg (Dropout2d 0.1, a 1x1 convolution to the classes).
    torchvision's DeepLabHead instead: 256-channel branches, a 1x1 projection with Dropout 0.5, then a 3x3
    ConvBNReLU."""

    def __init__(self, inputs: int = 2048, channels: int = 512, dilations=(1, 12, 24, 36), classes: int = 19):
        from torch import nn

        super().__init__()
        self.image_pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), _conv_module(inputs, channels, 1))
        self.aspp = nn.ModuleList(_conv_module(inputs, channels, 1 if d == 1 else 3, d) for d in dilations)
        self.bottleneck = _conv_module((len(dilations) + 1) * channels, channels, 3)
        self.cls_seg = nn.Sequential(nn.Dropout2d(0.1), nn.Conv2d(channels, classes, 1))

    def forward(self, x):
        pooled = torch.nn.functional.interpolate(self.image_pool(x), size=x.shape[2:], mode="bilinear",
                                                 align_corners=False)
        return self.cls_seg(self.bottleneck(torch.cat([pooled, *(branch(x) for branch in self.aspp)], dim=1)))


def mmseg_fcn_head(inputs: int = 1024, channels: int = 256, classes: int = 19) -> torch.nn.Sequential:
    """MMSeg's FCNHead as the R-50-D8 config's auxiliary head: one 3x3 ConvModule (num_convs=1, concat_input=False)
    to 256 channels, then cls_seg (Dropout2d 0.1, 1x1 convolution). torchvision's FCNHead: 3x3 to inputs/4 = 256
    channels, BatchNorm, ReLU, Dropout 0.1, 1x1: the same shapes."""
    from torch import nn

    return nn.Sequential(_conv_module(inputs, channels, 3), nn.Dropout2d(0.1), nn.Conv2d(channels, classes, 1))


def mmseg_deeplabv3(stem: str = "v1c", heads: str = "mmseg", classes: int = 19) -> torch.nn.Module:
    """DeepLabV3 with output stride 8 on a ResNet-50, assembled from torchvision's parts, for the memory comparison of
    bench/mmseg_architecture.py (not a built-in: the shipped recipe keeps torchvision's model, a declared deviation).

    stem "v1c": MMSeg's ResNetV1c (mmseg/models/backbones/resnet.py, deep_stem=True): three 3x3 convolutions
    (3->32 stride 2, 32->32, 32->64), each with BatchNorm and ReLU, before the max pool; "torchvision": the 7x7
    convolution (ResNetV1b, MMSeg's R-50b). The rest of the backbone is torchvision's resnet50 with
    replace_stride_with_dilation [False, True, True]: the bottleneck's stride on its 3x3 (MMSeg's style "pytorch") and
    each dilated stage's first block at half the dilation (MMSeg's contract_dilation=True), as the config sets.
    heads "mmseg": MMSegASPPHead and mmseg_fcn_head; "torchvision": DeepLabHead (rates 12, 24, 36) and FCNHead.
    The outputs are torchvision's DeepLabV3's: {"out", "aux"}, upsampled to the input's size."""
    import torchvision
    from torch import nn
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
    from torchvision.models.segmentation.fcn import FCNHead

    backbone = torchvision.models.resnet50(weights=None, replace_stride_with_dilation=[False, True, True])
    if stem == "v1c":  # bn1 and relu follow conv1 in torchvision's forward: they are the third conv's norm and ReLU
        backbone.conv1 = nn.Sequential(
            nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1, bias=False))
    elif stem != "torchvision":
        raise ValueError(f"stem: v1c or torchvision (got {stem!r})")
    layers = IntermediateLayerGetter(backbone, return_layers={"layer4": "out", "layer3": "aux"})
    if heads == "mmseg":
        return DeepLabV3(layers, MMSegASPPHead(classes=classes), mmseg_fcn_head(classes=classes))
    return DeepLabV3(layers, DeepLabHead(2048, classes, atrous_rates=(12, 24, 36)), FCNHead(1024, classes))
