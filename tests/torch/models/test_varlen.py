"""The varlen attention of `data.packing: packed` (models/varlen.py): registered with transformers, it attends within
each sample of a packed row from its position ids, without a dense mask, exactly as transformers' own block mask does
(float64), and build_model selects it for packed recipes only."""

from __future__ import annotations

import pytest
import torch
import transformers

from reproduce.data.packing import Grouped, Grouping, group
from reproduce.errors import UserError
from reproduce.models import build_model
from reproduce.models.hf import HFLogits, check_packed
from reproduce.models.varlen import VARLEN, register, runs_varlen, segments, use_varlen
from reproduce.plan.recipe import parse_recipe

CONFIGS = {
    "llama-gqa": lambda: transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                                  max_position_embeddings=64),
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=64),
}
LENGTHS = (5, 3, 7, 2, 6, 4, 1, 9)


def model_pair(name: str):
    """The same float64 model twice: on transformers' sdpa (the dense block mask for packed rows) and on VARLEN."""
    torch.manual_seed(0)
    config = {**CONFIGS, **WINDOWED}[name]
    dense = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa").double()
    varlen = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="sdpa").double()
    varlen.load_state_dict(dense.state_dict())
    assert use_varlen(HFLogits(varlen, "causal-lm")) and varlen.config._attn_implementation == VARLEN
    return HFLogits(dense.eval(), "causal-lm"), HFLogits(varlen.eval(), "causal-lm")  # (eval: no dropout)


def packed_rows(rows: int = 2):
    """`rows` rows of the LENGTHS samples back to back (the last row padded as a segment of its own)."""
    generator = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 32, (n,), generator=generator) for n in LENGTHS]
    per = len(samples) // rows
    width = max(sum(LENGTHS[r * per:(r + 1) * per]) for r in range(rows)) + 1
    input_ids = torch.zeros((rows, width), dtype=torch.long)
    positions = torch.zeros((rows, width), dtype=torch.long)
    spans = []
    for r in range(rows):
        start = 0
        for sample in samples[r * per:(r + 1) * per]:
            input_ids[r, start:start + len(sample)] = sample
            positions[r, start:start + len(sample)] = torch.arange(len(sample))
            spans.append((r, start, sample))
            start += len(sample)
        positions[r, start:] = torch.arange(width - start)
    return {"input_ids": input_ids, "position_ids": positions}, spans


def assert_packed_rows_are_each_sample_alone(dense, varlen, rows: int) -> None:
    """Logits and gradients of `rows` packed rows through VARLEN equal those through transformers' dense block mask,
    and each sample's logits its logits alone (float64): no token attends across a sample, none is left out."""
    inputs, spans = packed_rows(rows)
    outputs = {}
    for key, model in (("dense", dense), ("varlen", varlen)):
        model.zero_grad()
        logits = model(inputs)
        (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        outputs[key] = logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.testing.assert_close(outputs["varlen"][0], outputs["dense"][0], rtol=1e-12, atol=1e-12)
    for parameter, gradient in outputs["dense"][1].items():
        torch.testing.assert_close(outputs["varlen"][1][parameter], gradient, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        for row, start, sample in spans:
            alone = dense(sample[None])[0]
            torch.testing.assert_close(outputs["varlen"][0][row, start:start + len(sample)], alone, rtol=1e-12,
                                       atol=1e-12)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("rows", [1, 2])
def test_varlen_equals_the_block_mask_and_each_sample_alone_float64(name, rows, one_thread):
    """Packed rows through VARLEN compute what transformers' dense block mask and each sample alone do."""
    dense, varlen = model_pair(name)
    assert_packed_rows_are_each_sample_alone(dense, varlen, rows)
    check_packed(varlen, torch.device("cpu"))


WINDOWED = {  # sliding windows shorter than some LENGTHS: every layer's (Mistral), or one layer of two (Qwen2)
    "mistral": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                                  max_position_embeddings=64, sliding_window=4),
    "qwen2-mixed": lambda: transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=32,
                                                    max_position_embeddings=64, use_sliding_window=True,
                                                    sliding_window=3,
                                                    layer_types=["full_attention", "sliding_attention"]),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_a_sliding_window_shorter_than_a_sample_is_kept_by_varlen_float64(name, one_thread):
    """Under a sliding window each token attends to its own last `window` tokens: packed rows through VARLEN give
    transformers' sliding block mask's logits and gradients, and each sample's logits alone (float64)."""
    dense, varlen = model_pair(name)
    assert max(LENGTHS) > varlen.model.config.sliding_window
    assert_packed_rows_are_each_sample_alone(dense, varlen, 2)


def test_an_explicit_attention_mask_and_an_unpacked_row_are_sdpas():
    """No position ids (an unpacked row) or a 2D attention mask (here left padding): VARLEN computes what sdpa does."""
    dense, varlen = model_pair("llama-gqa")
    tokens = torch.randint(0, 32, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(tokens)
    mask[0, :4] = 0
    mask[2, :2] = 0
    with torch.no_grad():
        torch.testing.assert_close(varlen(tokens), dense(tokens), rtol=1e-12, atol=1e-12)
        both = {"input_ids": tokens, "attention_mask": mask}
        torch.testing.assert_close(varlen(both), dense(both), rtol=1e-12, atol=1e-12)


def test_segments_start_at_each_position_zero_and_each_row():
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])  # a row may start mid-sample (its own segment)
    assert segments(positions, 2, 5) == [0, 3, 5, 7, 10]


def test_build_model_selects_varlen_for_packed_transformers_models_only():
    body = {"batch": {"effective": 4}, "task": "language-modeling",
            "model": {"builtin": "llama-7b", "kwargs": {"hidden_size": 16, "intermediate_size": 32,
                                                         "num_hidden_layers": 1, "num_attention_heads": 2,
                                                         "num_key_value_heads": 2, "vocab_size": 32,
                                                         "max_position_embeddings": 32},
                      "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}},
            "data": {"factory": "factories:variable_lm"}, "optimizer": {"name": "sgd", "lr": 0.1},
            "schedule": {"total": {"steps": 1}}}
    ways = {}
    for way in ("none", "sorted", "packed"):
        ways[way] = runs_varlen(build_model(parse_recipe({**body, "data": {**body["data"], "packing": way}})))
    assert ways == {"none": False, "sorted": False, "packed": True}
    gpt = {**body, "model": {"builtin": "gpt", "kwargs": {"vocab_size": 32, "block_size": 16, "layers": 1,
                                                          "heads": 2, "dim": 16}},
           "data": {**body["data"], "packing": "packed"}}
    assert not runs_varlen(build_model(parse_recipe(gpt)))  # its own attention: refused by check_packed at the run


@pytest.mark.parametrize("seed", range(5))
def test_varlen_packed_micro_batches_are_one_row_of_their_samples_without_padding(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (60,), generator=generator)
    budget = 3 * int(lengths.max())
    grouping = Grouping("packed", budget, int(lengths.max()), lengths, 3, varlen=True)
    share = torch.randperm(60, generator=generator)[:29]
    samples = [(torch.arange(int(n)) % 32, torch.arange(int(n)) % 32) for n in lengths]
    dataset = Grouped(samples, grouping)
    groups = group(share, grouping, budget)
    assert sorted(torch.cat(groups).tolist()) == sorted(share.tolist())
    filled = [int(lengths[indices].sum()) for indices in groups]
    assert all(a + b > budget for i, a in enumerate(filled) for b in filled[i + 1:])  # first fit: none could merge
    for indices in groups:
        inputs, targets = dataset.batch(indices)
        assert inputs["input_ids"].shape == (1, int(lengths[indices].sum())) <= (1, budget)
        assert (targets != -100).sum() == int(lengths[indices].sum())  # every token a sample's: no padding
        assert int((inputs["position_ids"] == 0).sum()) == len(indices)


def test_registering_twice_keeps_one_entry():
    register()
    register()
    assert transformers.AttentionInterface._global_mapping[VARLEN].__name__ == "varlen_attention"


def test_the_varlen_check_runs_in_the_models_own_mode_and_fails_without_position_ids(monkeypatch):
    """check_packed under VARLEN: every attention call must have cut the row at its samples; it keeps the model's
    mode (eval would make bitsandbytes' CPU 4-bit layers repack into a kernel without a backward). A model whose
    attention never sees the position ids (here: they are dropped on the way) fails it."""
    from reproduce.models.hf import confines_packed

    _, varlen = model_pair("llama-gqa")
    varlen.train()
    assert confines_packed(varlen, torch.device("cpu")) and varlen.training
    from reproduce.models import varlen as module

    original = module.varlen_attention

    def without_positions(*args, **kwargs):
        kwargs.pop("position_ids", None)
        return original(*args, **kwargs)

    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, VARLEN, without_positions)
    assert not confines_packed(varlen, torch.device("cpu"))


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_model_whose_convolution_mixes_packed_samples_is_refused_whatever_its_attention(attention):
    """LFM2's short convolution sees the previous sample's last tokens while every attention call is cut (VARLEN, from
    sdpa) or block-masked (eager): the second sample's logits move with the first's tokens, so packing is refused."""
    config = transformers.Lfm2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     layer_types=["conv", "full_attention"])
    torch.manual_seed(0)
    model = HFLogits(transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention), "causal-lm")
    assert use_varlen(model) == (attention == "sdpa")
    with pytest.raises(UserError, match="a convolution, a state-space layer"):
        check_packed(model, torch.device("cpu"))
    _, llama = model_pair("llama-gqa")
    check_packed(llama.train(), torch.device("cpu"))  # attention alone mixes its tokens: accepted


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_varlen_row_computes_logits_at_its_target_tokens_only_with_the_same_loss_float64(name, one_thread):
    """A varlen packed micro-batch asks the model for the logits at its target tokens only (`logits_to_keep`: the
    lm_head and the loss skip the prompts, which bear no loss): the summed loss and every gradient equal those of
    the whole row's logits (float64); a model whose forward has no `logits_to_keep` gets every logit, then those
    kept; a micro-batch without targets keeps one position."""
    from reproduce.train.losses import TokenLoss

    _, model = model_pair(name)
    lengths = torch.tensor(LENGTHS)
    grouping = Grouping("packed", int(lengths.sum()), int(lengths.max()), lengths, 1, varlen=True)
    samples = []
    for n in LENGTHS:
        tokens = (torch.arange(n) * 5 + n) % 32
        targets = tokens.clone()
        targets[: n // 2] = -100  # a prompt without loss
        samples.append((tokens, targets))
    inputs, targets = Grouped(samples, grouping).batch(torch.arange(len(LENGTHS)))
    keep = inputs.pop("logits_to_keep")
    assert keep.tolist() == [i for i, t in enumerate(torch.cat([t for _, t in samples]).tolist()) if t != -100]
    full_row = torch.cat([t for _, t in samples])[None]
    assert torch.equal(targets, full_row[:, keep])
    results = []
    for kept in (None, keep):
        model.zero_grad()
        logits = model(inputs if kept is None else {**inputs, "logits_to_keep": kept})
        assert logits.shape[1] == (full_row.shape[1] if kept is None else len(keep))
        loss = TokenLoss()(logits, full_row if kept is None else targets)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-12, atol=0)
    for parameter, gradient in results[0][1].items():
        torch.testing.assert_close(results[1][1][parameter], gradient, rtol=1e-10, atol=1e-14)

    class NoKeep(torch.nn.Module):  # a causal LM whose forward takes no logits_to_keep
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids=None, use_cache=None):
            return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache)

    plain = HFLogits(NoKeep(model.model), "causal-lm")
    with torch.no_grad():
        torch.testing.assert_close(plain({**inputs, "logits_to_keep": keep}), model({**inputs, "logits_to_keep": keep}))
    none_bear_loss = [(tokens, torch.full_like(tokens, -100)) for tokens, _ in samples[:2]]
    inputs, targets = Grouped(none_bear_loss, grouping).batch(torch.arange(2))
    assert inputs["logits_to_keep"].tolist() == [0] and targets.tolist() == [[-100]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_collator_hands_the_samples_bounds_to_every_attention_call_bitwise_as_read_from_the_positions(
        name, one_thread, monkeypatch):
    """A varlen micro-batch (Grouped.batch) carries its samples' bounds as keyword arguments of the model's forward
    (`sample_sizes`; transformers' cu_seq_lens and max_length for flash-attention), which transformers hands to every
    attention call: no layer reads the position ids for them, and the loss and every gradient are bitwise those of
    the bounds read from the position ids at each layer (float64). A forward that takes no extra keyword arguments
    gets none (HFLogits drops them): its attention reads the position ids."""
    from reproduce.models import varlen as module
    from reproduce.models.hf import BOUNDS
    from reproduce.train.losses import TokenLoss

    _, model = model_pair(name)
    lengths = torch.tensor(LENGTHS)
    grouping = Grouping("packed", int(lengths.sum()), int(lengths.max()), lengths, 1, varlen=True)
    samples = [((torch.arange(n) * 3 + n) % 32, (torch.arange(n) * 7 + 1) % 32) for n in LENGTHS]
    order = torch.tensor([2, 0, 7, 4, 1, 5, 3, 6])
    inputs, targets = Grouped(samples, grouping).batch(order)
    sizes = [LENGTHS[i] for i in order]
    assert inputs["sample_sizes"] == tuple(sizes) and inputs["max_length_q"] == inputs["max_length_k"] == 9
    assert inputs["cu_seq_lens_q"].tolist() == [0, *torch.tensor(sizes).cumsum(0).tolist()]
    assert inputs["cu_seq_lens_q"].dtype == torch.int32 and inputs["cu_seq_lens_k"] is inputs["cu_seq_lens_q"]
    reads = []
    original = module.segments
    monkeypatch.setattr(module, "segments", lambda *args: reads.append(1) or original(*args))

    def step(inputs):
        model.zero_grad()
        loss = TokenLoss()(model(inputs), targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    cut = module.CALLS["cut"]
    handed = step(inputs)
    assert reads == [] and module.CALLS["cut"] == cut + 2  # both layers cut the row, from the bounds handed down
    positions = step({k: v for k, v in inputs.items() if k not in BOUNDS})
    assert len(reads) == 2  # every layer reads the position ids
    assert torch.equal(handed[0], positions[0])
    assert all(torch.equal(handed[1][n], positions[1][n]) for n in handed[1])

    class NoKwargs(torch.nn.Module):  # a causal LM whose forward hands nothing down
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids=None, use_cache=None, logits_to_keep=0):
            return self.inner(input_ids=input_ids, position_ids=position_ids, use_cache=use_cache,
                              logits_to_keep=logits_to_keep)

    with torch.no_grad():
        assert torch.equal(HFLogits(NoKwargs(model.model), "causal-lm")(inputs), model(inputs))
    assert len(reads) == 4


def test_kept_from_is_each_samples_first_kept_position_or_its_size():
    """`rows_kept_from` (data/packing.py kept_from): per sample, the first position whose logit is kept, counted from
    the sample's start; a sample with none kept gets its size (no row needed), as does one before the first kept."""
    from reproduce.data.packing import kept_from

    sizes = [4, 3, 5, 2]  # starts 0, 4, 7, 12
    assert kept_from(torch.tensor([2, 3, 9, 10, 11]), sizes) == (2, 3, 2, 2)
    assert kept_from(torch.tensor([0]), sizes) == (0, 3, 5, 2)  # a row without targets keeps its first position
    assert kept_from(torch.tensor([13]), sizes) == (4, 3, 5, 1)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_last_layer_attends_from_each_samples_first_kept_row_with_the_same_loss_float64(name, one_thread,
                                                                                           monkeypatch):
    """With the logits kept at the target tokens only, the last layer's outputs before a sample's first target feed
    nothing (LLaMA's and GPT-2's layers are per token after the attention), so its attention computes the rows from
    there, the others zero: the loss and every gradient equal those of every row computed (float64); earlier layers
    compute every row; a sample whose prompt is short computes every row; without `logits_to_keep` every row."""
    from reproduce.models import varlen as module
    from reproduce.train.losses import TokenLoss

    _, model = model_pair(name)
    lengths = (60, 9, 52, 44)  # prompts of 45, 6 (too few rows to skip), 51 (one target) and 44 (no target) tokens
    prompts = (45, 6, 51, 44)
    samples = []
    for n, prompt in zip(lengths, prompts, strict=True):
        tokens = (torch.arange(n) * 5 + n) % 32
        targets = tokens.clone()
        targets[:prompt] = -100
        samples.append((tokens, targets))
    grouping = Grouping("packed", sum(lengths), max(lengths), torch.tensor(lengths), 1, varlen=True)
    inputs, targets = Grouped(samples, grouping).batch(torch.arange(4))
    assert inputs["rows_kept_from"] == prompts
    firsts = []
    original = module.sample_attention
    monkeypatch.setattr(module, "sample_attention", lambda *args: firsts.append(args[-1]) or original(*args))

    def step(inputs):
        model.zero_grad()
        loss = TokenLoss()(model(inputs), targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    skipped = step(inputs)
    assert firsts == [0, 0, 0, 0, *prompts]  # layer 0 every row; the last layer from each first kept row
    firsts.clear()
    every = step({k: v for k, v in inputs.items() if k != "rows_kept_from"})
    assert firsts == [0] * 8
    torch.testing.assert_close(skipped[0], every[0], rtol=1e-12, atol=0)
    for parameter, gradient in every[1].items():
        torch.testing.assert_close(skipped[1][parameter], gradient, rtol=1e-10, atol=1e-14)
    firsts.clear()
    with torch.no_grad():  # every logit asked for: the last layer computes every row, whatever the batch carries
        whole = model({k: v for k, v in inputs.items() if k != "logits_to_keep"})
        assert firsts == [0] * 8
        alone = model({"input_ids": samples[0][0][None], "position_ids": torch.arange(60)[None]})
    torch.testing.assert_close(whole[:, :60], alone, rtol=1e-12, atol=1e-12)
