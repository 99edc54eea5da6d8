"""The papers' architectures, built from the libraries that define them (never re-typed), randomly initialised.

Each entry states the paper's configuration, its source, and where the library's model differs. transformers models
come from their config classes (wrapped in `HFLogits`: logits (B, T, V)); `model.kwargs` set config fields (nanoGPT's
`dropout` and `block_size` understood) or torchvision's arguments.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from ..errors import UserError
from .hf import HFLogits

IMAGE_CHANNELS = 3  # every image architecture here takes RGB
VOC_CLASSES = 21  # Pascal VOC 2012: 20 object classes and the background
DILATION = {8: [False, True, True], 16: [False, False, True]}  # ResNet's layer2..4 dilated instead of strided
ASPP_RATES = {8: (12, 24, 36), 16: (6, 12, 18)}  # Chen et al. 2017 sec. 3.3
KNOWN = ("num_classes", "output_stride", "aux_loss")  # a segmentation model's kwargs


@dataclass(frozen=True)
class Architecture:
    """A paper's architecture as its `library` builds it (torchvision, transformers, nanogpt or segmentation: the
    fields of each below): what it fixes about its inputs (`model_inputs`), and its build from kwargs and the data."""

    name: str
    title: str  # what it is, from which library
    library: str
    config: dict | None = None  # transformers, nanogpt: the paper's configuration, which `kwargs` override
    function: str = ""  # torchvision: the classifier's builder, `weights=None`, its head sized to the data's classes
    defaults: dict = field(default_factory=dict)
    image_size: int | None = None  # fixed by the architecture (ViT's position embeddings); None: any size
    config_class: str = ""  # transformers: built `from_config`
    auto_class: str = ""  # AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForPreTraining
    kind: str = "causal-lm"  # or masked-lm: logits (B, T, V); mae, pretraining: the model's own output
    aliases: dict = field(default_factory=dict)  # a kwarg name -> the config fields it sets
    position_offset: int = 0  # positions the model reserves (RoBERTa: padding index + 1)
    head: str = "deeplabv3"  # segmentation: "deeplabv3" / "fcn" on a ResNet, or "lraspp" on MobileNetV3
    backbone: str = "resnet50"
    output_stride: int = 8  # torchvision's own builds
    aux: bool = True  # whether torchvision has an auxiliary head for it

    def __call__(self, **kwargs: Any) -> nn.Module:
        return self.build(kwargs)

    def model_inputs(self, kwargs: dict) -> dict:
        if self.library == "segmentation":
            return {"inputs": "images", "channels": IMAGE_CHANNELS, "classes": kwargs.get("num_classes", VOC_CLASSES),
                    "targets": "masks"}
        if self.library == "torchvision":
            fixed = {"inputs": "images", "channels": IMAGE_CHANNELS, "classes": kwargs.get("num_classes", 1000)}
            if self.image_size is not None:
                fixed["image_size"] = kwargs.get("image_size", self.image_size)
            return fixed
        config = self.make_config(kwargs)
        if self.library == "nanogpt":
            return self.token_inputs(config.vocab_size, config.block_size)
        if self.kind == "mae":
            return {"inputs": "images", "channels": config.num_channels, "image_size": config.image_size}
        return self.token_inputs(config.vocab_size, getattr(config, "n_positions", None)
                                 or config.max_position_embeddings)

    def token_inputs(self, vocab_size: int | None, context: int | None) -> dict:
        """A token model's inputs: its positions less those it reserves (`position_offset`)."""
        fixed = {"inputs": "tokens", "vocab_size": vocab_size, "context": context - self.position_offset if context
                 else None}
        if self.kind == "pretraining":  # sentence pairs: masked-token labels and one next-sentence label per row
            fixed["targets"] = "mlm-nsp"
        return fixed

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
        if self.library == "segmentation":
            return self.segmentation_model(kwargs, data_info)
        if self.library == "torchvision":
            return self.classifier(kwargs, data_info)
        if self.library == "nanogpt":
            from .nanogpt import GPT

            config = self.make_config(kwargs)
            check_vocab_size(data_info, config.vocab_size, "model", self.name, WIDEN)
            return GPT(config)
        transformers = needs_transformers(f"model.builtin: {self.name}")
        data_info = data_info or {}
        if self.kind == "mae" and data_info.get("image_size") and "image_size" not in kwargs:
            kwargs = {**kwargs, "image_size": int(data_info["image_size"])}
        config = self.make_config(kwargs)
        if self.kind != "mae":
            check_vocab_size(data_info, config.vocab_size, "model", self.name, WIDEN)
        return self.wrap(getattr(transformers, self.auto_class).from_config(config))

    def wrap(self, model: nn.Module) -> nn.Module:
        return (PretrainingOutput if self.kind in ("pretraining", "mae") else HFLogits)(model, self.kind)

    def make_config(self, kwargs: dict) -> Any:
        if self.library == "nanogpt":
            from .nanogpt import GPTConfig

            known = [f.name for f in fields(GPTConfig)]
            for key in kwargs:
                if key not in known:
                    raise self.unknown_setting(key, known, f"nanoGPT's GPTConfig: {', '.join(known)}")
            try:
                config = GPTConfig(**{**(self.config or {}), **kwargs})
            except TypeError as exc:
                raise UserError(f"model.kwargs: {self.name} rejected its configuration: {exc}") from None
            if config.n_embd % config.n_head:
                raise UserError(f"model.kwargs: {self.name}: n_embd {config.n_embd} is not a multiple of n_head "
                                f"{config.n_head}")
            return config
        config_type = getattr(needs_transformers(f"model.builtin: {self.name}"), self.config_class)
        known = set(config_type().to_dict())
        settings = dict(self.config or {})
        for key, value in kwargs.items():
            if key in self.aliases:
                settings.update({target: value for target in self.aliases[key]})
            elif key in known:
                settings[key] = value
            else:
                raise self.unknown_setting(key, known | set(self.aliases), f"see transformers.{self.config_class}")
        try:
            return config_type(**settings)
        except (TypeError, ValueError) as exc:
            raise UserError(f"model.kwargs: {self.name} rejected its configuration: {exc}") from None

    def classifier(self, kwargs: dict, data_info: dict | None) -> nn.Module:
        torchvision = self.torchvision(data_info)
        data_info = data_info or {}
        arguments = {**self.defaults, **kwargs}
        if "num_classes" not in kwargs and data_info.get("classes"):
            arguments["num_classes"] = int(data_info["classes"])
        if self.image_size is not None and "image_size" not in kwargs and data_info.get("image_size"):
            arguments["image_size"] = int(data_info["image_size"])
        try:
            return getattr(torchvision.models, self.function)(weights=None, **arguments)
        except (TypeError, ValueError) as exc:
            raise UserError(f"model.kwargs: {self.name} ({self.function}) rejected its arguments: {exc}") from None

    def segmentation_model(self, kwargs: dict, data_info: dict | None) -> nn.Module:
        """LR-ASPP, or a ResNet model assembled as torchvision's `_deeplabv3_resnet` / `_fcn_resnet` do, at the output
        stride's dilation."""
        unknown = sorted(set(kwargs) - set(KNOWN))
        if unknown:
            raise UserError(f"model.kwargs: {self.name} has no setting {unknown[0]!r} (it takes {', '.join(KNOWN)})")
        torchvision = self.torchvision(data_info)
        declared = (data_info or {}).get("classes")
        if kwargs.get("num_classes") and declared and kwargs["num_classes"] != declared:
            raise UserError(f"model.kwargs.num_classes: {kwargs['num_classes']} output channels, but data.classes is "
                            f"{declared}: the model predicts one channel per class (remove num_classes)")
        classes = int(kwargs.get("num_classes") or declared or VOC_CLASSES)
        stride = kwargs.get("output_stride") or self.output_stride
        allowed = (16,) if self.head == "lraspp" else tuple(DILATION)
        if stride not in allowed:
            raise UserError(f"model.output_stride: {self.name} takes {' or '.join(map(str, allowed))} (got {stride})")
        aux = bool(kwargs.get("aux_loss"))
        if aux and not self.aux:
            raise UserError(f"model.aux_weight: {self.name} has no auxiliary head in torchvision (remove aux_weight)")
        from torchvision.models import segmentation

        if self.head == "lraspp":
            return segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=classes)
        from torchvision.models._utils import IntermediateLayerGetter
        from torchvision.models.segmentation.deeplabv3 import DeepLabHead, DeepLabV3
        from torchvision.models.segmentation.fcn import FCN, FCNHead

        stride = int(stride)
        backbone = getattr(torchvision.models, self.backbone)(weights=None,
                                                               replace_stride_with_dilation=DILATION[stride])
        returned = {"layer4": "out", **({"layer3": "aux"} if aux else {})}
        layers = IntermediateLayerGetter(backbone, return_layers=returned)
        aux_head = FCNHead(1024, classes) if aux else None
        if self.head == "fcn":
            return FCN(layers, FCNHead(2048, classes), aux_head)
        return DeepLabV3(layers, DeepLabHead(2048, classes, atrous_rates=ASPP_RATES[stride]), aux_head)

    def torchvision(self, data_info: dict | None) -> Any:
        try:
            import torchvision
        except (ImportError, RuntimeError) as exc:  # RuntimeError: a torchvision built for another torch
            raise UserError(f"model.builtin: {self.name} needs torchvision, which does not import here: {exc}"
                            ) from None
        channels = (data_info or {}).get("channels")
        if channels is not None and channels != IMAGE_CHANNELS:
            raise UserError(f"data.channels: {self.name} takes {IMAGE_CHANNELS}-channel images (got {channels})")
        return torchvision

    def unknown_setting(self, key: str, known: Any, elsewhere: str) -> UserError:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else elsewhere
        return UserError(f"model.kwargs: {self.name} has no setting {key!r} ({hint})")


WIDEN = " (model.kwargs: {{vocab_size: {vocab}}} to widen it)"


def check_vocab_size(data_info: dict | None, vocab_size: int, field: str, model: str, hint: str = "") -> None:
    """One line when the data has more token ids than the model's vocabulary (`hint`: how to widen it)."""
    vocab = (data_info or {}).get("vocab_size")
    if vocab is not None and vocab > vocab_size:
        raise UserError(f"{field}: the data has {vocab} token ids but {model} has a vocabulary of {vocab_size}"
                        + hint.format(vocab=vocab))


def needs_transformers(who: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(f"{who} needs transformers, which is not installed (pip install transformers)") from None
    return transformers


class PretrainingOutput(HFLogits):
    """A model whose loss takes its own pre-training output: ViTMAE's, or BERT's masked-LM and next-sentence logits."""

    def forward(self, inputs: Any) -> Any:
        if self.kind == "mae":
            return self.model(pixel_values=inputs)
        output = self.model(**(dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}))
        return output.prediction_logits, output.seq_relationship_logits


class MaskedPixelLoss:
    """MAE's loss (norm_pix_loss), summed over the micro-batch's images: every image has the same number of masked
    patches, so ViTMAE's mean over the micro-batch's masked patches times its images is the sum of their means."""

    def count(self, target: Any) -> int:
        return len(target)

    def __call__(self, output: Any, target: Any) -> Any:
        return output.loss * output.mask.shape[0]


_GPT2_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
_NANOGPT_NAMES = {"dropout": _GPT2_DROPOUT, "block_size": ("n_positions",)}  # nanoGPT's GPTConfig names

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        # He et al. 2016 (arXiv 1512.03385), as ResNet v1.5 (Goyal et al. 2017) without its zero-initialised gammas.
        Architecture("resnet50", "ResNet-50 (torchvision)", "torchvision", function="resnet50"),
        # Dosovitskiy et al. 2021 (arXiv 2010.11929), Table 1; pre-training head (sec. 3.1), dropout (App. B.1).
        Architecture("vit-b16", "ViT-B/16 (torchvision)", "torchvision", function="vit_b_16", image_size=224,
                     defaults={"representation_size": 768, "dropout": 0.1}),
        # Touvron et al. 2021 (arXiv 2012.12877), Table 1; its drop-path 0.1 is not in torchvision's ViT (left out).
        Architecture("deit-b", "DeiT-B = ViT-B/16 (torchvision)", "torchvision", function="vit_b_16", image_size=224),
        # He et al. 2022 (arXiv 2111.06377); facebookresearch/mae @ efb2a80 mae_vit_large_patch16_dec512d8b, PRETRAIN.md
        Architecture(
            "mae-vit-large-patch16", "MAE ViT-L/16 encoder + 8-block decoder (transformers ViTMAE)", "transformers",
            config_class="ViTMAEConfig", auto_class="AutoModelForPreTraining", kind="mae",
            config={
                "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                "decoder_hidden_size": 512, "decoder_num_hidden_layers": 8, "decoder_num_attention_heads": 16,
                "decoder_intermediate_size": 2048, "layer_norm_eps": 1e-6, "image_size": 224, "patch_size": 16,
                "mask_ratio": 0.75, "norm_pix_loss": True,
            },
        ),
        # karpathy/nanoGPT @ 3adf61e model.py, train.py's bias=False: nanoGPT prints it as 123.59M parameters.
        Architecture("nanogpt", "nanoGPT's GPT (reproduce.models.nanogpt, nanoGPT's state_dict names)", "nanogpt",
                     config={"bias": False}),
        # GPT-2 124M as nanoGPT (@ 3adf61e config/train_gpt2.py) and llm.c train it: no dropout, vocabulary padded
        # to 50304; with biases, as llm.c (@ f1e2ace train_gpt2.cu) keeps them (nanoGPT's bias=False: `nanogpt`).
        Architecture(
            "gpt2-124m", "GPT-2 124M (transformers GPT-2)", "transformers", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50304, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                    **dict.fromkeys(_GPT2_DROPOUT, 0.0)},
        ),
        # Brown et al. 2020 (arXiv 2005.14165), Table 2.1: GPT-3 Small, context 2048. GPT-3's locally banded sparse
        # layers (sec. 2.1) are dense here: the same parameters, more attention memory. Dropout 0.1 (UNVERIFIED).
        Architecture(
            "gpt3-small", "GPT-3 Small 125M, dense attention (transformers GPT-2)", "transformers",
            config_class="GPT2Config", auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50257, "n_positions": 2048, "n_embd": 768, "n_layer": 12, "n_head": 12},
        ),
        # Radford et al. 2019 GPT-2 Medium, as microsoft/LoRA @ c4593f0 examples/NLG fine-tunes it.
        Architecture(
            "gpt2-medium", "GPT-2 Medium 355M (transformers GPT-2)", "transformers", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16},
        ),
        # nanoGPT's config/train_shakespeare_char.py @ 3adf61e, 65 characters; with biases (+0.03M parameters).
        Architecture(
            "gpt-char", "nanoGPT shakespeare-char 10.7M (transformers GPT-2)", "transformers",
            config_class="GPT2Config", auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 65, "n_positions": 256, "n_embd": 384, "n_layer": 6, "n_head": 6,
                    "bos_token_id": None, "eos_token_id": None, **dict.fromkeys(_GPT2_DROPOUT, 0.2)},
        ),
        # Devlin et al. 2019 (arXiv 1810.04805) sec. 3, A.1; google-research/bert @ eedf571 uncased_L-12_H-768_A-12.
        Architecture(
            "bert-base", "BERT-base, masked-LM + next-sentence heads (transformers BertForPreTraining)", "transformers",
            config_class="BertConfig", auto_class="AutoModelForPreTraining", kind="pretraining",
            config={"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2},
        ),
        # BERT-Large (Devlin et al. 2019 sec. 3; uncased_L-24_H-1024_A-16), as You et al. 2019 pre-train it.
        Architecture(
            "bert-large", "BERT-Large, masked-LM + next-sentence heads (transformers BertForPreTraining)",
            "transformers", config_class="BertConfig", auto_class="AutoModelForPreTraining", kind="pretraining",
            config={"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2},
        ),
        # Liu et al. 2019 (arXiv 1907.11692); fairseq roberta.base @ 3d262bb: 514 positions, 512 after padding.
        Architecture(
            "roberta-base", "RoBERTa-base, masked-LM head (transformers RoBERTa)", "transformers",
            config_class="RobertaConfig", auto_class="AutoModelForMaskedLM", kind="masked-lm", position_offset=2,
            config={"vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "max_position_embeddings": 514, "type_vocab_size": 1,
                    "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        ),
        # Touvron et al. 2023 (arXiv 2302.13971), Table 2: LLaMA-7B; SwiGLU hidden 11008, untied head (params.json).
        Architecture(
            "llama-7b", "LLaMA-7B (transformers LLaMA)", "transformers", config_class="LlamaConfig",
            auto_class="AutoModelForCausalLM",
            config={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False},
        ),
    )
}

SEGMENTATION_MODELS: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        # Chen et al. 2017 (arXiv 1706.05587) sec. 3.3; the auxiliary FCN head is torchvision's, not the paper's.
        Architecture("deeplabv3-resnet50", "DeepLabV3 ResNet-50 (torchvision)", "segmentation"),
        Architecture("deeplabv3-resnet101", "DeepLabV3 ResNet-101 (torchvision)", "segmentation", backbone="resnet101"),
        Architecture("fcn-resnet50", "FCN ResNet-50, dilated (torchvision)", "segmentation", head="fcn"),
        # Howard et al. 2019 (arXiv 1905.02244) sec. 6.2: LR-ASPP on MobileNetV3-Large, last block dilated (stride 16).
        Architecture("lraspp-mobilenet-v3-large", "LR-ASPP MobileNetV3-Large (torchvision)", "segmentation",
                     head="lraspp", backbone="mobilenet_v3_large", output_stride=16, aux=False),
    )
}


def _bert_loss() -> Any:
    from ..train.pretraining_loss import MaskedLMNextSentenceLoss

    return MaskedLMNextSentenceLoss()


LOSSES = {"mae-masked-pixel-mse": MaskedPixelLoss, "bert-mlm-nsp": _bert_loss}
