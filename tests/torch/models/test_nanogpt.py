"""nanoGPT's own GPT as a built-in (`nanogpt`): nanoGPT's state_dict names and shapes, its parameter counts as it
prints them, tied embeddings, causal attention, its initialisation and dropout; it trains through the accumulation
loop exactly like one large batch, its model.pt loads strictly into a fresh one and becomes a sample.py checkpoint,
and the estimate meter runs it on fake tensors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import ADAMW, assert_same_weights, lm_recipe, run_accumulated, run_plain
from reproduce.models import MODELS, count_parameters, model_inputs
from reproduce.models.nanogpt import GPT, GPTConfig
from reproduce.models.nanogpt import main as export_main
from reproduce.plan.recipe import load_recipe, parse_recipe

PAPERS = Path(__file__).resolve().parents[3] / "papers"
SHAKESPEARE = {"n_layer": 6, "n_head": 6, "n_embd": 384, "block_size": 256, "dropout": 0.2, "bias": False,
               "vocab_size": 65}  # config/train_shakespeare_char.py and its 65-character vocabulary
TINY = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 32, "dropout": 0.0, "bias": False}


def nanogpt_state_shapes(n_layer: int, n_embd: int, vocab: int, block: int, bias: bool) -> dict:
    """nanoGPT's state_dict, written out from its model.py's module tree (with flash attention: no mask buffer)."""
    shapes = {"transformer.wte.weight": (vocab, n_embd), "transformer.wpe.weight": (block, n_embd)}
    for i in range(n_layer):
        block_shapes = {
            "ln_1.weight": (n_embd,), "attn.c_attn.weight": (3 * n_embd, n_embd),
            "attn.c_proj.weight": (n_embd, n_embd), "ln_2.weight": (n_embd,),
            "mlp.c_fc.weight": (4 * n_embd, n_embd), "mlp.c_proj.weight": (n_embd, 4 * n_embd),
        }
        if bias:
            block_shapes.update({"ln_1.bias": (n_embd,), "attn.c_attn.bias": (3 * n_embd,),
                                 "attn.c_proj.bias": (n_embd,), "ln_2.bias": (n_embd,),
                                 "mlp.c_fc.bias": (4 * n_embd,), "mlp.c_proj.bias": (n_embd,)})
        shapes.update({f"transformer.h.{i}.{name}": shape for name, shape in block_shapes.items()})
    shapes["transformer.ln_f.weight"] = (n_embd,)
    if bias:
        shapes["transformer.ln_f.bias"] = (n_embd,)
    shapes["lm_head.weight"] = (vocab, n_embd)
    return shapes


@pytest.mark.parametrize("bias", [False, True])
def test_state_dict_has_nanogpts_names_and_shapes(bias):
    with torch.device("meta"):
        model = MODELS["nanogpt"](**{**SHAKESPEARE, "bias": bias})
    state = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    assert state == nanogpt_state_shapes(6, 384, 65, 256, bias)


def test_parameter_counts_as_nanogpt_prints_them():
    with torch.device("meta"):
        char = MODELS["nanogpt"](**SHAKESPEARE)
        gpt2 = MODELS["nanogpt"]()  # the defaults: GPT-2 124M, vocabulary 50304, bias=False (train.py)
    assert f"{char.get_num_params() / 1e6:.2f}M" == "10.65M"  # "number of parameters: 10.65M"
    assert char.get_num_params(non_embedding=False) == 10_745_088 == count_parameters(char)[0]
    assert f"{gpt2.get_num_params() / 1e6:.2f}M" == "123.59M" and gpt2.get_num_params() == 123_587_328
    assert count_parameters(gpt2)[0] == 123_587_328 + 1024 * 768  # with the position embeddings


def test_the_nanogpt_recipes_build_it_with_the_papers_counts():
    from reproduce.cli.papers import parameter_counts

    for name, total in (("nanogpt-shakespeare-char", 10_745_088), ("nanogpt-gpt2-124m", 124_373_760)):
        recipe = load_recipe(PAPERS / f"{name}.yaml")
        assert recipe.model.builtin == "nanogpt" and recipe.model.kwargs["bias"] is False
        assert parameter_counts(recipe) == (total, total)
    assert load_recipe(PAPERS / "llmc-gpt2-124m.yaml").model.builtin == "gpt2-124m"  # llm.c keeps the biases


def test_embeddings_are_tied():
    model = GPT(GPTConfig(**TINY))
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.bias is None
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    model(torch.randint(0, 32, (2, 8))).sum().backward()
    assert model.lm_head.weight.grad is model.transformer.wte.weight.grad


def reference_forward(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """The architecture written out by hand: explicit masked softmax attention, exact erf GELU, LayerNorm."""
    config, sd = model.config, model.state_dict()
    width, heads = config.n_embd, config.n_head
    batch, length = tokens.shape

    def norm(x, name):
        mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * sd[name + ".weight"]

    x = sd["transformer.wte.weight"][tokens] + sd["transformer.wpe.weight"][:length]
    future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        q, k, v = (norm(x, p + "ln_1") @ sd[p + "attn.c_attn.weight"].T).split(width, dim=2)
        q, k, v = (t.view(batch, length, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(width // heads)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + attended.transpose(1, 2).reshape(batch, length, width) @ sd[p + "attn.c_proj.weight"].T
        hidden = norm(x, p + "ln_2") @ sd[p + "mlp.c_fc.weight"].T
        x = x + (0.5 * hidden * (1 + torch.erf(hidden / math.sqrt(2)))) @ sd[p + "mlp.c_proj.weight"].T
    return norm(x, "transformer.ln_f") @ sd["lm_head.weight"].T


def test_forward_is_the_architecture_with_causal_attention():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).double().eval()
    tokens = torch.randint(0, 32, (3, 12))
    logits = model(tokens)
    assert logits.shape == (3, 12, 32)
    torch.testing.assert_close(logits, reference_forward(model, tokens), rtol=1e-10, atol=1e-10)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 32  # a later token cannot change what earlier positions predict
    after = model(changed)
    torch.testing.assert_close(after[:, :7], logits[:, :7], rtol=0, atol=0)
    assert not torch.allclose(after[:, 7:], logits[:, 7:])
    with pytest.raises(ValueError, match="longer than block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_initialisation_is_nanogpts():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**SHAKESPEARE, "n_layer": 4, "bias": True}))
    residual = 0.02 / math.sqrt(2 * 4)
    for name, parameter in model.named_parameters():
        if name.endswith("c_proj.weight"):
            assert parameter.std().item() == pytest.approx(residual, rel=0.03), name
        elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert parameter.std().item() == pytest.approx(0.02, rel=0.03), name
            assert abs(parameter.mean().item()) < 1e-3, name
        elif "ln_" in name and name.endswith(".weight"):
            assert torch.equal(parameter, torch.ones_like(parameter)), name
        else:  # every bias starts at zero
            assert name.endswith(".bias") and not parameter.any(), name


def test_dropout_where_nanogpt_has_it():
    model = GPT(GPTConfig(**{**TINY, "dropout": 0.2}))
    dropouts = {name: module.p for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout)}
    expected = {"transformer.drop"} | {f"transformer.h.{i}.{where}" for i in range(2)
                                       for where in ("attn.resid_dropout", "mlp.dropout")}
    assert dropouts == dict.fromkeys(expected, 0.2) and model.transformer.h[0].attn.dropout == 0.2  # on attention
    assert model.transformer.h[0].mlp.gelu.approximate == "none"  # the exact GELU
    tokens = torch.randint(0, 32, (2, 8))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    model.train()
    assert not torch.equal(model(tokens), model(tokens))


def test_unknown_setting_and_vocabulary_are_user_errors():
    from reproduce.errors import UserError

    with pytest.raises(UserError, match=r"nanogpt has no setting 'n_layers' \(did you mean 'n_layer'\?\)"):
        MODELS["nanogpt"](n_layers=2)
    with pytest.raises(UserError, match="n_embd 30 is not a multiple of n_head 4"):
        MODELS["nanogpt"](n_embd=30, n_head=4)
    recipe = parse_recipe(nanogpt_recipe())
    assert model_inputs(recipe) == {"inputs": "tokens", "vocab_size": 32, "context": 16}
    with pytest.raises(UserError, match="the data has 40 token ids but nanogpt has a vocabulary of 32"):
        MODELS["nanogpt"].build(TINY, {"vocab_size": 40})


def nanogpt_recipe() -> dict:
    recipe = lm_recipe(ADAMW)
    recipe["model"] = {"builtin": "nanogpt", "kwargs": TINY}
    return recipe


def test_accumulation_equals_one_large_batch_and_model_pt_loads_strictly(tmp_path, capsys):
    recipe = nanogpt_recipe()
    plan, _, ours, data = run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    assert plan.accumulation_steps == 4
    assert_same_weights(ours, run_plain(recipe, data, steps=3), rtol=1e-6, atol=1e-12)
    fresh = GPT(GPTConfig(**TINY)).double()
    assert not fresh.load_state_dict(ours, strict=True).missing_keys
    # the ckpt.pt nanoGPT's sample.py reads (init_from='resume'): model_args, model, config.dataset
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out"), "--n-head", "2", "--dataset", "toy"]) == 0
    checkpoint = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    assert checkpoint["model_args"] == TINY and checkpoint["config"] == {"dataset": "toy"}
    again = GPT(GPTConfig(**checkpoint["model_args"]))
    again.load_state_dict(checkpoint["model"], strict=True)
    tokens = torch.randint(0, 32, (1, 5))
    torch.testing.assert_close(again.double().eval()(tokens), fresh.eval()(tokens))
    assert export_main([str(tmp_path / "run"), str(tmp_path / "out"), "--n-head", "2"]) == 2  # never overwrites
    assert "exists" in capsys.readouterr().err


def test_the_estimate_meter_runs_it_on_fake_tensors():
    from reproduce.hardware.catalog import lookup
    from reproduce.probe.meters import EstimateMeter
    from reproduce.probe.workload import Workload

    recipe = load_recipe(PAPERS / "nanogpt-shakespeare-char.yaml")
    gpu = lookup("a100-40gb")
    meter = EstimateMeter(Workload(recipe), gpu.budget_bytes, 0.0, gpu=gpu, cap=64)
    trial = meter.measure(8)
    assert trial.fits and trial.parts["attention"] == {"flash": 6 * 2 * 2}  # 6 blocks x 2 micro-batches x 2 steps


def test_papers_show_prints_nanogpts_own_count(capsys, monkeypatch, tmp_path):
    from reproduce.cli import main
    from reproduce.cli.papers import NANOGPT_DEFAULTS

    assert {name: getattr(GPTConfig(), name) for name in NANOGPT_DEFAULTS} == NANOGPT_DEFAULTS
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))
    for name, line in (("nanogpt-shakespeare-char", "10,745,088 parameters (nanoGPT prints 10.65M"),
                       ("nanogpt-gpt2-124m", "124,373,760 parameters (nanoGPT prints 123.59M")):
        with pytest.raises(SystemExit):
            main(["papers", "--dir", str(PAPERS), "show", name])
        assert f"  model: nanogpt, {line}: without the position embeddings)" in capsys.readouterr().out
