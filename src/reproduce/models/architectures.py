"""The papers' architectures, built from the libraries that define them (never re-typed), randomly initialised.

Each entry states the paper's configuration and where it comes from, and where the library's model differs from
the paper's. Transformers models come from their config classes through `from_config` (random weights, nothing is
ever downloaded) and are wrapped in `HFLogits`, so a language model returns logits (B, T, V) like every language
model here; torchvision's classifiers return (B, C). Both libraries are imported on first build only, and a build
costs next to nothing on `torch.device("meta")` (the estimate meter's way).

A recipe's `model.kwargs` change the configuration: config fields for transformers models (`n_layer: 6`, with
nanoGPT's `dropout` and `block_size` understood), constructor arguments for torchvision's (`dropout: 0.1`).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import UserError
from .hf import HFLogits

IMAGE_CHANNELS = 3  # every image architecture here takes RGB


@dataclass(frozen=True)
class Architecture:
    """A paper's architecture: what it fixes about its inputs, and a build from a recipe's kwargs and the data."""

    name: str
    title: str  # what it is, from which library

    def model_inputs(self, kwargs: dict) -> dict:
        raise NotImplementedError

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
        raise NotImplementedError

    def __call__(self, **kwargs: Any) -> nn.Module:
        return self.build(kwargs)

    def torchvision(self, data_info: dict | None) -> Any:
        """torchvision, for a model of RGB images (the data's channels checked)."""
        try:
            import torchvision
        except (ImportError, RuntimeError) as exc:  # RuntimeError: a torchvision built for another torch
            raise UserError(f"model.builtin: {self.name} needs torchvision, which does not import here: {exc}"
                            ) from None
        channels = (data_info or {}).get("channels")
        if channels is not None and channels != IMAGE_CHANNELS:
            raise UserError(f"data.channels: {self.name} takes {IMAGE_CHANNELS}-channel images (got {channels})")
        return torchvision

    def check_vocabulary(self, data_info: dict | None, vocab_size: int) -> None:
        vocab = (data_info or {}).get("vocab_size")
        if vocab is not None and vocab > vocab_size:
            raise UserError(f"model: the data has {vocab} token ids but {self.name} has a vocabulary of "
                            f"{vocab_size} (model.kwargs: {{vocab_size: {vocab}}} to widen it)")

    def unknown_setting(self, key: str, known: Any, elsewhere: str) -> UserError:
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else elsewhere
        return UserError(f"model.kwargs: {self.name} has no setting {key!r} ({hint})")


@dataclass(frozen=True)
class TorchvisionClassifier(Architecture):
    """A torchvision classification model, `weights=None`, its head sized to the data's classes."""

    function: str = ""
    defaults: dict = field(default_factory=dict)
    image_size: int | None = None  # fixed by the architecture (ViT's position embeddings); None: any size

    def model_inputs(self, kwargs: dict) -> dict:
        fixed = {"inputs": "images", "channels": IMAGE_CHANNELS, "classes": kwargs.get("num_classes", 1000)}
        if self.image_size is not None:
            fixed["image_size"] = kwargs.get("image_size", self.image_size)
        return fixed

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
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


@dataclass(frozen=True)
class TransformersModel(Architecture):
    """A transformers model from its config class: `config` is the paper's configuration, `kwargs` override it."""

    config_class: str = ""
    auto_class: str = ""  # AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForPreTraining
    kind: str = "causal-lm"  # causal-lm / masked-lm: logits (B, T, V); mae: MAE's pre-training output;
    # pretraining: BERT's masked-LM and next-sentence logits
    config: dict = field(default_factory=dict)
    aliases: dict = field(default_factory=dict)  # a kwarg name -> the config fields it sets
    position_offset: int = 0  # positions the model reserves (RoBERTa: padding index + 1)

    def make_config(self, kwargs: dict) -> Any:
        transformers = needs_transformers(f"model.builtin: {self.name}")
        config_type = getattr(transformers, self.config_class)
        known = set(config_type().to_dict())
        settings = dict(self.config)
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

    def model_inputs(self, kwargs: dict) -> dict:
        config = self.make_config(kwargs)
        if self.kind == "mae":
            return {"inputs": "images", "channels": config.num_channels, "image_size": config.image_size}
        context = getattr(config, "n_positions", None) or config.max_position_embeddings
        fixed = {"inputs": "tokens", "vocab_size": config.vocab_size, "context": context - self.position_offset}
        if self.kind == "pretraining":  # sentence pairs: masked-token labels and one next-sentence label per row
            fixed["targets"] = "mlm-nsp"
        return fixed

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
        transformers = needs_transformers(f"model.builtin: {self.name}")
        data_info = data_info or {}
        if self.kind == "mae" and data_info.get("image_size") and "image_size" not in kwargs:
            kwargs = {**kwargs, "image_size": int(data_info["image_size"])}
        config = self.make_config(kwargs)
        if self.kind != "mae":
            self.check_vocabulary(data_info, config.vocab_size)
        return self.wrap(getattr(transformers, self.auto_class).from_config(config))

    def wrap(self, model: nn.Module) -> nn.Module:
        """The transformers model with the forward this architecture's loss takes (logits, or its own output)."""
        return (PretrainingOutput if self.kind in ("pretraining", "mae") else HFLogits)(model, self.kind)


@dataclass(frozen=True)
class NanoGPTModel(Architecture):
    """nanoGPT's own GPT (models/nanogpt.py): `kwargs` are nanoGPT's GPTConfig fields (n_layer, n_head, n_embd,
    block_size, vocab_size, dropout, bias); the defaults are GPT-2 124M as nanoGPT's train.py trains it."""

    config: dict = field(default_factory=dict)

    def make_config(self, kwargs: dict) -> Any:
        from .nanogpt import GPTConfig

        known = GPTConfig.names()
        for key in kwargs:
            if key not in known:
                raise self.unknown_setting(key, known, f"nanoGPT's GPTConfig: {', '.join(known)}")
        try:
            config = GPTConfig(**{**self.config, **kwargs})
        except TypeError as exc:
            raise UserError(f"model.kwargs: {self.name} rejected its configuration: {exc}") from None
        if config.n_embd % config.n_head:
            raise UserError(f"model.kwargs: {self.name}: n_embd {config.n_embd} is not a multiple of n_head "
                            f"{config.n_head}")
        return config

    def model_inputs(self, kwargs: dict) -> dict:
        config = self.make_config(kwargs)
        return {"inputs": "tokens", "vocab_size": config.vocab_size, "context": config.block_size}

    def build(self, kwargs: dict, data_info: dict | None = None) -> nn.Module:
        from .nanogpt import GPT

        config = self.make_config(kwargs)
        self.check_vocabulary(data_info, config.vocab_size)
        return GPT(config)


def needs_transformers(who: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise UserError(f"{who} needs transformers, which is not installed (pip install transformers)") from None
    return transformers


class PretrainingOutput(HFLogits):
    """A model whose loss takes its own pre-training output.

    mae: images in, ViTMAE's output out (its loss over the masked patches, mask, pixels): it encodes a random
    `1 - mask_ratio` of each image's patches and reconstructs the rest; `mae-masked-pixel-mse` is its loss.
    pretraining: BERT's (BertForPreTraining) masked-LM logits (B, T, V) and next-sentence logits (B, 2), from a dict
    of input_ids, token_type_ids and attention_mask as `reproduce.data.pairs` builds them (or input_ids alone);
    `bert-mlm-nsp` is its loss.
    """

    def forward(self, inputs: Any) -> Any:
        if self.kind == "mae":
            return self.model(pixel_values=inputs)
        output = self.model(**(dict(inputs) if isinstance(inputs, dict) else {"input_ids": inputs}))
        return output.prediction_logits, output.seq_relationship_logits


class MaskedPixelLoss:
    """MAE's loss: the squared error of the masked patches' pixels (normalised per patch with norm_pix_loss, as
    MAE's pre-training command sets), a mean per image, summed over the micro-batch.

    ViTMAE keeps the same number of patches, int(L x (1 - mask_ratio)), in every image, so each image has the
    same number of masked patches, and the model's loss (the mean over all masked patches of the micro-batch,
    MAE's own `forward_loss`) is the mean of the images' means: times the batch size it is their sum, which the
    training loop divides by the window's image count like any other loss.
    """

    def count(self, target: Any) -> int:
        return len(target)

    def __call__(self, output: Any, target: Any) -> Any:
        return output.loss * output.mask.shape[0]


_GPT2_DROPOUT = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
_NANOGPT_NAMES = {"dropout": _GPT2_DROPOUT, "block_size": ("n_positions",)}  # nanoGPT's GPTConfig names

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        # He et al. 2016, "Deep Residual Learning" (arXiv 1512.03385), Table 1: [3, 4, 6, 3] bottleneck blocks.
        # torchvision puts the stride 2 of a downsampling block on its 3x3 convolution (ResNet "v1.5", the variant of
        # fb.resnet.torch that Goyal et al. 2017 trained) where He et al. put it on the first 1x1: the same
        # parameters. Goyal et al.'s zero-initialised last BN gamma of each block is not applied (random init).
        TorchvisionClassifier("resnet50", "ResNet-50 (torchvision)", function="resnet50"),
        # Dosovitskiy et al. 2021 (arXiv 2010.11929), Table 1: ViT-Base, 12 layers, width 768, MLP 3072, 12 heads,
        # patch 16, resolution 224; pre-training head "a MLP with one hidden layer" (sec. 3.1: tanh pre-logits of
        # 768, google-research/vision_transformer's representation_size), dropout 0.1 (App. B.1, Table 3).
        TorchvisionClassifier(
            "vit-b16", "ViT-B/16 (torchvision)", function="vit_b_16", image_size=224,
            defaults={"representation_size": 768, "dropout": 0.1},
        ),
        # Touvron et al. 2021 (arXiv 2012.12877), Table 1: DeiT-B is ViT-B/16 (86M) with a linear head, no dropout.
        # Its stochastic depth (drop-path 0.1) is not in torchvision's ViT: left out (a mask per sample and block).
        TorchvisionClassifier("deit-b", "DeiT-B = ViT-B/16 (torchvision)", function="vit_b_16", image_size=224),
        # He et al. 2022 (arXiv 2111.06377); facebookresearch/mae @ efb2a80 models_mae.py
        # mae_vit_large_patch16_dec512d8b: encoder ViT-L/16 (1024 wide, 24 layers, 16 heads, MLP 4096), decoder
        # 512 wide, 8 layers, 16 heads, LayerNorm eps 1e-6; PRETRAIN.md: --mask_ratio 0.75 --norm_pix_loss.
        TransformersModel(
            "mae-vit-large-patch16", "MAE ViT-L/16 encoder + 8-block decoder (transformers ViTMAE)",
            config_class="ViTMAEConfig", auto_class="AutoModelForPreTraining", kind="mae",
            config={
                "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
                "decoder_hidden_size": 512, "decoder_num_hidden_layers": 8, "decoder_num_attention_heads": 16,
                "decoder_intermediate_size": 2048, "layer_norm_eps": 1e-6, "image_size": 224, "patch_size": 16,
                "mask_ratio": 0.75, "norm_pix_loss": True,
            },
        ),
        # nanoGPT's own model.py GPT (karpathy/nanoGPT @ 3adf61e): GPT-2 124M's shape, 12 layers, 12 heads, 768 wide,
        # context 1024, the vocabulary of 50257 padded to 50304, and train.py's bias=False: no bias in any Linear or
        # LayerNorm, tied embeddings, dropout 0 (train.py's default). nanoGPT prints it as 123.59M parameters
        # (without the position embeddings); shakespeare-char's 6 x 6 x 384 as 10.65M.
        NanoGPTModel("nanogpt", "nanoGPT's GPT (reproduce.models.nanogpt, nanoGPT's state_dict names)",
                     config={"bias": False}),
        # GPT-2 124M as nanoGPT (karpathy/nanoGPT @ 3adf61e, config/train_gpt2.py, model.py) and llm.c train it:
        # 12 layers, 12 heads, 768 wide, context 1024, no dropout, the vocabulary of 50257 padded to 50304 (a
        # multiple of 64, for speed). transformers' GPT-2 has biases in every Linear and LayerNorm where nanoGPT
        # sets bias=False (+0.1M parameters: nanoGPT's recipes build `nanogpt` instead); llm.c keeps them, as here
        # (llm.c @ f1e2ace train_gpt2.cu fill_in_parameter_sizes: 16 tensors, a bias beside every weight and
        # LayerNorm scale, wte tied to the output, the vocabulary padded to 50304).
        TransformersModel(
            "gpt2-124m", "GPT-2 124M (transformers GPT-2)", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50304, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
                    **dict.fromkeys(_GPT2_DROPOUT, 0.0)},
        ),
        # Brown et al. 2020 (arXiv 2005.14165), Table 2.1: GPT-3 Small, 12 layers, d_model 768, 12 heads of 64,
        # context 2048, GPT-2's 50257-token BPE. GPT-3 alternates dense and locally banded sparse attention layers
        # (sec. 2.1, as in the Sparse Transformer); transformers' GPT-2 has dense attention in every layer, which
        # holds the same parameters but more attention memory. Dropout is not stated: GPT-2's 0.1 is kept (UNVERIFIED).
        TransformersModel(
            "gpt3-small", "GPT-3 Small 125M, dense attention (transformers GPT-2)", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50257, "n_positions": 2048, "n_embd": 768, "n_layer": 12, "n_head": 12},
        ),
        # Radford et al. 2019 GPT-2 Medium, as microsoft/LoRA @ c4593f0 examples/NLG (gpt2.md) fine-tunes it: 24 layers,
        # 16 heads, 1024 wide, context 1024, vocabulary 50257, dropout 0.1.
        TransformersModel(
            "gpt2-medium", "GPT-2 Medium 355M (transformers GPT-2)", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 50257, "n_positions": 1024, "n_embd": 1024, "n_layer": 24, "n_head": 16},
        ),
        # nanoGPT's character-level Shakespeare model (config/train_shakespeare_char.py @ 3adf61e): 6 layers, 6 heads,
        # 384 wide, block 256, dropout 0.2, the 65 characters of the text as vocabulary (data/shakespeare_char).
        # nanoGPT's bias=False is not available in transformers' GPT-2 (+0.03M bias parameters).
        TransformersModel(
            "gpt-char", "nanoGPT shakespeare-char 10.7M (transformers GPT-2)", config_class="GPT2Config",
            auto_class="AutoModelForCausalLM", aliases=_NANOGPT_NAMES,
            config={"vocab_size": 65, "n_positions": 256, "n_embd": 384, "n_layer": 6, "n_head": 6,
                    "bos_token_id": None, "eos_token_id": None, **dict.fromkeys(_GPT2_DROPOUT, 0.2)},
        ),
        # Devlin et al. 2019 (arXiv 1810.04805), sec. 3: BERT-base, L 12, H 768, A 12, 110M; google-research/bert
        # @ eedf571 bert_config.json of uncased_L-12_H-768_A-12: vocabulary 30522, 512 positions, 2 token types,
        # GELU, dropout 0.1 (transformers' BertConfig defaults). With both pre-training heads (sec. 3.1, A.1; the
        # repo's run_pretraining.py): the masked-LM head (a dense + LayerNorm transform, the output tied to the
        # word embeddings) and the next-sentence head (the pooler's tanh of [CLS], a 2-way classifier).
        TransformersModel(
            "bert-base", "BERT-base, masked-LM + next-sentence heads (transformers BertForPreTraining)",
            config_class="BertConfig", auto_class="AutoModelForPreTraining", kind="pretraining",
            config={"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2},
        ),
        # BERT-Large (Devlin et al. 2019 sec. 3: L 24, H 1024, A 16, 340M; uncased_L-24_H-1024_A-16's
        # bert_config.json: intermediate 4096), with both pre-training heads, as You et al. 2019 pre-train it.
        TransformersModel(
            "bert-large", "BERT-Large, masked-LM + next-sentence heads (transformers BertForPreTraining)",
            config_class="BertConfig", auto_class="AutoModelForPreTraining", kind="pretraining",
            config={"vocab_size": 30522, "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                    "intermediate_size": 4096, "max_position_embeddings": 512, "type_vocab_size": 2},
        ),
        # Liu et al. 2019 (arXiv 1907.11692): BERT-base's shape with GPT-2's byte-level BPE; fairseq roberta.base
        # (@ 3d262bb, 125M): vocabulary 50265, 514 positions (512 tokens after the padding index 1), one token type,
        # LayerNorm eps 1e-5.
        TransformersModel(
            "roberta-base", "RoBERTa-base, masked-LM head (transformers RoBERTa)", config_class="RobertaConfig",
            auto_class="AutoModelForMaskedLM", kind="masked-lm", position_offset=2,
            config={"vocab_size": 50265, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "max_position_embeddings": 514, "type_vocab_size": 1,
                    "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2},
        ),
        # Touvron et al. 2023 (arXiv 2302.13971), Table 2: LLaMA-7B, dimension 4096, 32 heads, 32 layers, context
        # 2048; SwiGLU hidden 11008 (2/3 x 4d rounded up to a multiple of 256), RMSNorm eps 1e-6, rotary positions,
        # SentencePiece vocabulary of 32000, untied output head (the released params.json).
        TransformersModel(
            "llama-7b", "LLaMA-7B (transformers LLaMA)", config_class="LlamaConfig",
            auto_class="AutoModelForCausalLM",
            config={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 2048,
                    "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False},
        ),
    )
}

def _bert_loss() -> Any:
    from ..train.pretraining_loss import MaskedLMNextSentenceLoss

    return MaskedLMNextSentenceLoss()


LOSSES = {"mae-masked-pixel-mse": MaskedPixelLoss, "bert-mlm-nsp": _bert_loss}
