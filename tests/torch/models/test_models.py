"""The papers' architectures: built from their libraries in the papers' configurations, their parameter counts checked
against the published ones; every shipped recipe builds its model (on the meta device) and its synthetic batch; MAE's
loss; the estimate probe on an image and a token paper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from reproduce.cli import main
from reproduce.models import LOSSES, MODELS, build_model, count_parameters, model_inputs
from reproduce.plan import builtin_names
from reproduce.plan.recipe import load_recipe, parse_recipe
from reproduce.probe.workload import Workload

PAPERS = Path(__file__).resolve().parents[3] / "papers"
# the papers' own recipes whose data is not here (not the small built-in demos that read data from disk: --data)
PLAN_ONLY = [p for p in sorted(PAPERS.glob("*.yaml")) if not load_recipe(p).data.available
             and load_recipe(p).model.builtin not in builtin_names.SMALL_MODELS]

# Published figures are rounded to two or three significant digits, and libraries differ from the papers' code in
# small ways (biases: nanoGPT has none, Keras's ResNet-50 has them in its convolutions): 1% either way.
TOLERANCE = 0.01


def everything(model: nn.Module) -> int:
    return count_parameters(model)[0]


def without(*prefixes: str):
    def count(model: nn.Module) -> int:
        return sum(p.numel() for name, p in model.named_parameters() if not name.startswith(prefixes))
    return count


def mae_encoder(model: nn.Module) -> int:
    return everything(model.model.vit)


PUBLISHED = [
    # built-in, what is counted, published count, its source
    ("resnet50", everything, 25.6e6, "keras.io/api/applications: ResNet50, 25.6M parameters"),
    ("bert-base", everything, 110e6, "Devlin et al. 2019 sec. 3: BERT-base, Total Parameters = 110M"),
    ("bert-large", everything, 336e6, "google-bert/bert-large-uncased model card: 336M (the paper rounds to 340M)"),
    ("gpt2-124m", everything, 124e6, "openai/gpt-2's 124M model (its recount of the paper's 117M); nanoGPT README"),
    ("llama-7b", everything, 6.7e9, "Touvron et al. 2023 Table 2: 6.7B"),
    # the Transformer without its classification head, whose size depends on the dataset (21843 classes here)
    ("vit-b16", without("heads."), 86e6, "Dosovitskiy et al. 2021 Table 1: ViT-Base, 86M"),
    ("deit-b", everything, 86e6, "Touvron et al. 2021 Table 1: DeiT-B, 86M (1000 classes)"),
    ("roberta-base", everything, 125e6, "fairseq examples/roberta/README.md: roberta.base, 125M"),
    ("gpt2-medium", everything, 354.92e6, "Hu et al. 2021 Table 3: GPT-2 M (FT), 354.92M trainable parameters"),
    ("mae-vit-large-patch16", mae_encoder, 304e6, "ViT-L/16 encoder, 304M, as MAE's comparisons quote it"),
    # nanoGPT's model.py reports its count without the position embeddings: "number of parameters: 10.65M"
    ("gpt-char", without("model.transformer.wpe."), 10.65e6, "nanoGPT README, shakespeare-char: 10.65M"),
    # nanoGPT's own GPT, bias=False, vocabulary 50304 (its train.py defaults): "number of parameters: 123.59M"
    ("nanogpt", without("transformer.wpe."), 123.59e6, "nanoGPT train.py with config/train_gpt2.py: 123.59M"),
]


@pytest.fixture(scope="module")
def built():
    cache = {}

    def build(name: str) -> nn.Module:
        if name not in cache:
            with torch.device("meta"):
                cache[name] = MODELS[name]()
        return cache[name]
    return build


@pytest.mark.parametrize("name, count, published, source", PUBLISHED, ids=[row[0] for row in PUBLISHED])
def test_parameter_count_matches_the_paper(name, count, published, source, built):
    counted = count(built(name))
    assert abs(counted - published) <= TOLERANCE * published, f"{name}: {counted:,} vs {published:,.0f} ({source})"


def test_every_named_architecture_is_registered_and_published():
    named = {load_recipe(path).model.builtin for path in PAPERS.glob("*.yaml")}
    assert named <= set(MODELS) == set(builtin_names.MODELS)
    assert set(LOSSES) == set(builtin_names.LOSSES)
    from_torchvision = {name for name, arch in MODELS.items() if getattr(arch, "library", None) == "torchvision"}
    assert from_torchvision == set(builtin_names.TORCHVISION_MODELS)
    papers = {row[0] for row in PUBLISHED}
    segmentation = set(builtin_names.SEGMENTATION_MODELS)  # their sizes: tests/torch/models/test_segmentation_models.py
    assert papers | {"gpt3-small"} | segmentation == set(MODELS) - set(builtin_names.SMALL_MODELS)
    with torch.device("meta"):  # GPT-3 Small: GPT-2 124M with 2048 positions and the unpadded vocabulary
        assert abs(everything(MODELS["gpt3-small"]()) - 125e6) <= TOLERANCE * 125e6  # Brown et al. Table 2.1


def last_linear(model: nn.Module) -> nn.Linear:
    return [m for m in model.modules() if isinstance(m, nn.Linear)][-1]


@pytest.mark.parametrize("path", PLAN_ONLY, ids=[p.stem for p in PLAN_ONLY])
def test_paper_builds_its_model_and_synthetic_batch(path):
    """Data that is not here still has the shape the paper trains on, and the model takes it: the vocabulary and
    context of a language model, the image size and classes of a classifier (the head is sized to the data)."""
    recipe = load_recipe(path)
    workload = Workload(recipe)
    info = workload.data.info
    with torch.device("meta"):
        model = build_model(recipe, info)
    inputs, target = workload.batch(2)
    fixed = model_inputs(recipe)
    if fixed.get("targets") == "mlm-nsp":  # BERT's sentence pairs: the masked-LM labels and a next-sentence label
        length = recipe.batch.sequence_length
        assert set(inputs) == {"input_ids", "token_type_ids", "attention_mask"} and target.shape == (2, length + 1)
        inputs = inputs["input_ids"]
        assert int(inputs.max()) < fixed["vocab_size"] == info["vocab_size"] and length <= fixed["context"]
        assert model.model.cls.predictions.decoder.out_features == fixed["vocab_size"]
    elif fixed["inputs"] == "tokens":
        length = recipe.batch.sequence_length or recipe.data.max_length
        assert inputs.shape == target.shape == (2, length) and inputs.dtype == torch.int64
        assert length <= fixed["context"] and int(inputs.max()) < fixed["vocab_size"] == info["vocab_size"]
        assert last_linear(model).out_features == fixed["vocab_size"]  # logits over the whole vocabulary
    elif recipe.task == "segmentation":  # the training crop, a mask of class ids each; the logits per pixel
        height, width = recipe.data.crop
        assert inputs.shape == (2, 3, height, width) and target.shape == (2, height, width)
        assert int(target.max()) < recipe.data.classes == info["classes"]
        assert [m for m in model.modules() if isinstance(m, nn.Conv2d)][-1].out_channels == recipe.data.classes
    else:
        assert inputs.shape == (2, 3, 224, 224) and target.shape == (2,)
        if recipe.task == "classification":
            assert last_linear(model).out_features == info["classes"]
    expected = {"imagenet-1k": 1000, "imagenet-21k": 21843}.get(recipe.data.name)
    if expected is not None:
        assert info["classes"] == expected


def test_recipe_fields_override_the_dataset_defaults():
    recipe = parse_recipe({
        "batch": {"effective": 64}, "task": "classification", "model": {"builtin": "vit-b16"},
        "data": {"name": "imagenet-1k", "available": False, "image_size": 384, "classes": 10},
        "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 3}},
    })
    workload = Workload(recipe)
    inputs, _ = workload.batch(1)
    assert inputs.shape == (1, 3, 384, 384)
    with torch.device("meta"):
        model = build_model(recipe, workload.data.info)
    assert model.image_size == 384 and last_linear(model).out_features == 10  # position embeddings for 24 x 24


def test_mae_encodes_a_quarter_and_its_loss_is_the_sum_of_per_image_means():
    """A small ViTMAE, real on the CPU: the encoder sees 1 + L/4 tokens, and mae-masked-pixel-mse equals the per-image
    mean squared error of the masked patches (per-patch normalised pixels), summed over the batch."""
    torch.manual_seed(0)
    small = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
             "decoder_hidden_size": 16, "decoder_num_hidden_layers": 1, "decoder_num_attention_heads": 2,
             "decoder_intermediate_size": 32, "image_size": 32, "patch_size": 8}
    model = MODELS["mae-vit-large-patch16"](**small)
    images = torch.randn(3, 3, 32, 32)
    output = model(images)
    patches = (32 // 8) ** 2
    assert output.mask.shape == (3, patches) and (output.mask.sum(1) == patches * 3 // 4).all()
    encoded = model.model.vit(pixel_values=images, noise=torch.rand(3, patches)).last_hidden_state
    assert encoded.shape[1] == 1 + patches // 4
    target = model.model.patchify(images)
    target = (target - target.mean(-1, keepdim=True)) / (target.var(-1, keepdim=True) + 1e-6) ** 0.5
    per_patch = ((output.logits - target) ** 2).mean(-1)
    per_image = (per_patch * output.mask).sum(1) / output.mask.sum(1)
    loss = LOSSES["mae-masked-pixel-mse"]()
    torch.testing.assert_close(loss(output, torch.zeros(3)), per_image.sum())
    assert loss.count(torch.zeros(3)) == 3


def test_unknown_config_setting_is_a_user_error():
    from reproduce.errors import UserError

    with pytest.raises(UserError, match=r"gpt2-124m has no setting 'n_layr' \(did you mean 'n_layer'\?\)"):
        MODELS["gpt2-124m"](n_layr=2)


def run_json(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    return json.loads(captured.out)


def test_resnet50_paper_probes_on_a_consumer_card(capsys, monkeypatch, tmp_path):
    """The image representative: ImageNet's shape, ResNet-50, the estimate meter, no option but the card and the
    paper's 256 processes (each then needs at most the paper's per-device 32: two trials)."""
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))
    path = PAPERS / "goyal2017-resnet50.yaml"
    result = run_json(["probe", str(path), "--gpu", "rtx4090", "--world-size", "256", "--json"], capsys)
    assert result["meter"] == "estimate" and "3 x 224 x 224 inputs, 1000 classes" in result["data"]
    assert result["micro_batch_max"] == 32 == result["cap"]  # Goyal et al. ran 32 per GPU (on 16 GB P100s)
    assert result["plan"]["arithmetic"] == "32 x 1 x 256 = 8192"


def test_shakespeare_char_paper_probes_on_a_consumer_card(capsys, monkeypatch, tmp_path):
    """The token representative (full-size LLaMA-7B trials take about 15 s each here: bench/papers_probe.py plans
    Alpaca-LoRA and every other paper): the vocabulary from the model, 256-token sequences, no other option."""
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))
    path = PAPERS / "nanogpt-shakespeare-char.yaml"
    result = run_json(["probe", str(path), "--gpu", "rtx4090", "--json"], capsys)
    assert result["meter"] == "estimate" and "synthetic tokens (256 x vocabulary 65)" in result["data"]
    assert result["micro_batch_max"] == 64 == result["cap"]  # nanoGPT's whole batch of 64 fits at once
    assert result["plan"]["arithmetic"] == "64 x 1 x 1 = 64 sequences (16384 tokens)"
