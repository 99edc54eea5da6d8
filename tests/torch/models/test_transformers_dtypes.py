"""The model a run trains is the model transformers builds (models/weights.py `in_dtype`).

Every buffer and parameter of a built-in or a folder's model in bf16 / fp16 has the dtype transformers'
`from_config` / `from_pretrained(..., dtype=...)` gives it (the rotary `inv_freq` stays float32), and the trained model
of a run gives, on a few hundred tokens, exactly the logits of its adapter/ put by peft on transformers' own model of
the weights folder, quantised by transformers' BitsAndBytesConfig where the recipe quantises (int8 in fp16, nf4 in
bf16, as Alpaca-LoRA and QLoRA load their bases), for LLaMA and GPT-2. Real transformers, peft and bitsandbytes on
the CPU; tiny random-weight folders written here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import yaml

from helpers import cli, pretrained_files
from reproduce.plan.recipe import parse_recipe

transformers = pytest.importorskip("transformers")

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
BUILT_INS = {  # built-in name: its kwargs for a small model, transformers' config class and auto class
    "llama-7b": ({**SMALL, "num_key_value_heads": 4, "vocab_size": 128}, "LlamaConfig", "AutoModelForCausalLM"),
    "gpt2-124m": ({"n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 128}, "GPT2Config", "AutoModelForCausalLM"),
    "bert-base": ({**SMALL, "vocab_size": 128}, "BertConfig", "AutoModelForPreTraining"),
    "roberta-base": ({**SMALL, "vocab_size": 128}, "RobertaConfig", "AutoModelForMaskedLM"),
    "mae-vit-large-patch16": ({**SMALL, "decoder_hidden_size": 32, "decoder_num_hidden_layers": 1,
                               "decoder_num_attention_heads": 4, "decoder_intermediate_size": 64, "image_size": 32},
                              "ViTMAEConfig", "AutoModelForPreTraining"),
}


def dtypes(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.dtype]:
    """Every parameter's and buffer's dtype by its name in the transformers model (a wrapper's prefix dropped)."""
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return {name.removeprefix(prefix): tensor.dtype for name, tensor in tensors}


def recipe(model: dict, **extra) -> dict:
    return {"batch": {"effective": 4}, "task": "language-modeling", "model": model,
            "data": {"available": False, "format": "instructions", "template": "alpaca", "max_length": 160,
                     "shuffle": False}, "optimizer": {"name": "adamw", "lr": 1e-2},
            "schedule": {"total": {"steps": 2}}, **extra}


@pytest.mark.parametrize("builtin", sorted(BUILT_INS))
def test_a_built_in_has_the_dtypes_from_config_gives_it(builtin, dtype="bf16"):
    """(fp16 weights train only under LoRA: the runs below compare those, adapters and all.)"""
    from reproduce.models import build_model

    kwargs, config_class, auto_class = BUILT_INS[builtin]
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        plain = recipe({"builtin": builtin, "kwargs": kwargs, "dtype": dtype}, precision=dtype)
        ours = build_model(parse_recipe(plain))
        config = getattr(transformers, config_class)(**{**ours.model.config.to_dict()})
        theirs = getattr(transformers, auto_class).from_config(config, dtype=DTYPES[dtype])
    assert dtypes(ours, "model.") == dtypes(theirs)
    if builtin == "llama-7b":  # the case that differed: model.to(bf16) rounded the rotary frequencies
        assert dtypes(ours, "model.")["model.rotary_emb.inv_freq"] == torch.float32


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """tiny-llama/, tiny-gpt2/ (the samples' folders, GPT-2 64 wide), tiny-mistral/ and tiny-qwen2/
    (save_pretrained here), and alpaca.json."""
    # GPT-2 64 wide: bitsandbytes' CPU 4-bit inference takes no layer narrower than its block of 64
    root = pretrained_files(tmp_path_factory.mktemp("dtypes"), n_embd=64)
    for name, config_class in (("mistral", "MistralConfig"), ("qwen2", "Qwen2Config")):
        config = getattr(transformers, config_class)(**SMALL, num_key_value_heads=2, vocab_size=512)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / f"tiny-{name}")
    return root


@pytest.mark.parametrize("folder", ["tiny-llama", "tiny-gpt2", "tiny-mistral", "tiny-qwen2"])
def test_a_folder_has_the_dtypes_from_pretrained_gives_it(folder, folders):
    from reproduce.models import build_model

    ours = build_model(parse_recipe(recipe({"hf": str(folders / folder), "dtype": "bf16"}, precision="bf16")))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folders / folder, dtype=torch.bfloat16)
    assert dtypes(ours, "model.") == dtypes(theirs)


CASES = [  # (folder, built-in, LoRA targets, quantize, model.dtype = precision)
    ("tiny-llama", "llama-7b", ["q_proj", "v_proj"], "int8", "fp16"),  # Alpaca-LoRA's base
    ("tiny-llama", "llama-7b", ["q_proj", "v_proj"], "nf4", "bf16"),  # QLoRA's base
    ("tiny-llama", "llama-7b", ["q_proj", "v_proj"], None, "bf16"),
    ("tiny-llama", "llama-7b", ["q_proj", "v_proj"], None, "fp16"),
    ("tiny-gpt2", "gpt2-medium", ["c_attn"], "nf4", "bf16"),
    ("tiny-gpt2", "gpt2-medium", ["c_attn"], None, "fp16"),
]


@pytest.mark.parametrize(("folder", "builtin", "targets", "quantize", "dtype"), CASES)
def test_the_trained_model_is_the_adapter_on_transformers_own_base(folder, builtin, targets, quantize, dtype,
                                                                    folders, tmp_path, capsys, one_thread):
    """Two optimizer steps, then the trained model (plan.yaml's recipe, model.pt) against
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype, quantization_config), adapter/)
    on 300 tokens: the same logits, to the bit, under the run's autocast and without. A quantised base is then
    prepared as the papers' code prepares it before training (peft's prepare_model_for_kbit_training: the weights
    left unquantised, norms and embeddings, in float32), as the run's base is."""
    import peft

    from reproduce.models import build_model
    from reproduce.models.quantize import quantization_config

    model = {"builtin": builtin, "dtype": dtype, "lora": {"r": 2, "alpha": 4, "target_modules": targets},
             **({"quantize": quantize} if quantize else {})}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(model, precision=dtype)))
    code, out, err = cli(capsys, "run", path, "--weights", folders / folder, "--data", folders / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "2")
    assert code == 0, err
    assert len(transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "adapter")) == 512  # the data's tokenizer
    planned = parse_recipe(yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["recipe"])
    trained = build_model(planned)
    trained.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = {"quantization_config": quantization_config(planned)} if quantize else {}
        base = transformers.AutoModelForCausalLM.from_pretrained(folders / folder, dtype=DTYPES[dtype], **extra)
        if quantize:
            base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
    # peft's wrapper around ours holds the loop's HFLogits around transformers' model: one `model.` more
    assert dtypes(trained.eval(), "base_model.model.model.") == dtypes(adapted, "base_model.model.")
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        untrained = transformers.AutoModelForCausalLM.from_pretrained(folders / folder, dtype=DTYPES[dtype])
        assert not torch.equal(untrained(input_ids=ids).logits, adapted(input_ids=ids).logits)  # the adapters moved
        assert torch.equal(trained(ids), adapted(input_ids=ids).logits)
        with torch.autocast("cpu", dtype=DTYPES[dtype]):  # as the run computes
            assert torch.equal(trained(ids), adapted(input_ids=ids).logits)
