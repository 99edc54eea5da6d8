"""data.packing (data/packing.py): sorted and packed micro-batches keep each window's samples and the large batch's
gradient exactly; packed samples attend only within themselves; every rank runs as many backward passes."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from helpers import cli, cli_json, reproduce_run, run_plain
from reproduce.data import build_data
from reproduce.data.packing import Grouped, Grouping, balance, group, grouping_of, next_fit
from reproduce.errors import UserError
from reproduce.models.hf import HFLogits, check_packed
from reproduce.plan.overlay import Change, overlay
from reproduce.plan.packing import DEFAULT_WHY, kept_grouping
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import default_packing, load_recipe, parse_recipe
from reproduce.plan.resume_rules import replan
from reproduce.train.trainer import RunRequest, train
from reproduce.train.windows import window
from reproduce.verify.accumulation import verify

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 32, "max_position_embeddings": 32}


def llama_lora(packing: str | None = None, effective: int = 16, steps: int = 3, **data) -> dict:
    return {
        "batch": {"effective": effective},
        "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": TINY_LLAMA,
                  "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "data": {"factory": "factories:variable_lm", "shuffle": True, **({"packing": packing} if packing else {}),
                 **data},
        "optimizer": {"name": "adamw", "lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1},
        "schedule": {"total": {"steps": steps}},
    }


def random_grouping(way: str, seed: int, samples: int = 40) -> Grouping:
    generator = random.Random(seed)
    lengths = torch.tensor([generator.choice([2, 3, 5, 9, 17, 30, 31]) for _ in range(samples)])
    return Grouping(way, budget=int(lengths.max()) * 3, row=int(lengths.max()), lengths=lengths, micro_batch=3)


@pytest.mark.parametrize("way", ["sorted", "packed"])
@pytest.mark.parametrize("seed", range(6))
def test_a_share_groups_into_micro_batches_within_the_budget_holding_each_sample_once(way, seed):
    grouping = random_grouping(way, seed)
    share = torch.randperm(40, generator=torch.Generator().manual_seed(seed))[:23]
    groups = group(share, grouping, grouping.budget)
    assert sorted(torch.cat(groups).tolist()) == sorted(share.tolist())
    for indices in groups:
        lengths = grouping.lengths[indices].tolist()
        if way == "sorted":  # rows x the longest row
            assert len(lengths) * max(lengths) <= grouping.budget or len(lengths) == 1
        else:  # rows of at most `row` tokens (the collate's next fit rebuilds them), budget // row of them
            rows = next_fit(lengths, grouping.row)
            assert all(sum(lengths[i] for i in row) <= grouping.row for row in rows)
            assert len(rows) <= grouping.budget // grouping.row


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_a_window_grouped_again_is_handed_the_same_groups_and_another_is_grouped_anew(way):
    """A run groups each window for its micro-batches and again for its record (train/windows.py): the same share,
    grouping and budget give the same groups (a new list, so balancing one never changes the other); another share,
    budget or grouping of the same lengths is grouped on its own."""
    grouping = random_grouping(way, 0)
    share = torch.randperm(40, generator=torch.Generator().manual_seed(0))[:23]
    first = group(share, grouping, grouping.budget)
    again = group(share.clone(), grouping, grouping.budget)
    assert again is not first and len(again) == len(first)
    assert all(a is b for a, b in zip(again, first, strict=True))  # the kept index tensors themselves
    balance([again, [torch.arange(3)] * (len(first) + 2)])  # (splits into its own copy of the list)
    assert group(share, grouping, grouping.budget) == first
    for other in (group(share, grouping, grouping.row), group(share[:-1], grouping, grouping.budget),
                  group(share, random_grouping(way, 0), grouping.budget)):
        assert not any(a is b for a in other for b in first)
    assert [g.tolist() for g in group(share, random_grouping(way, 0), grouping.budget)] == [g.tolist() for g in first]


def test_balance_gives_every_rank_as_many_micro_batches_splitting_or_adding_empty_ones():
    one = [torch.tensor([0, 1, 2, 3])]
    three = [torch.tensor([4]), torch.tensor([5]), torch.tensor([6])]
    single = [torch.tensor([7])]
    balanced = balance([one, three, single])
    assert [len(groups) for groups in balanced] == [3, 3, 3]
    assert sorted(torch.cat(balanced[0]).tolist()) == [0, 1, 2, 3]
    assert [len(g) for g in balanced[2]] == [1, 0, 0]  # one sample: two empty micro-batches beside it


def grouped_plan(recipe: dict, world_size: int = 1, micro: int = 4):
    spec = parse_recipe(recipe)
    data = build_data(spec)
    return spec, data, make_plan(spec, micro_batch_max=micro, world_size=world_size, dataset_size=len(data.train),
                            policy="fast" if recipe["batch"]["effective"] % (world_size * micro) else "exact")


@pytest.mark.parametrize("way", ["sorted", "packed"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_steps_sample_ids_are_the_unpacked_plans_on_every_rank(way, world_size):
    """The sample ids of every optimizer step (epoch boundaries and a partial last window included), per rank, are
    those of `none`; every rank has as many micro-batches."""
    recipe = llama_lora(way, effective=18, steps=9)
    recipe["data"]["drop_last"] = False
    spec, data, plan = grouped_plan(recipe, world_size, micro=2)
    grouping = grouping_of(spec, data.train, plan.micro_batch)
    size = len(data.train)
    partials = 0
    for step in range(plan.optimizer_steps):
        counts = set()
        for rank in range(world_size):
            plain, partial = window(plan, size, step, 7, rank)
            grouped, partial_too = window(plan, size, step, 7, rank, grouping=grouping)
            assert partial == partial_too
            assert sorted(torch.cat(grouped).tolist()) == sorted(torch.cat(plain).tolist()), (step, rank)
            counts.add(len(grouped))
            partials += partial
        assert len(counts) == 1, f"step {step}: ranks run {counts} micro-batches"
    assert partials  # a partial window was among them


@pytest.mark.parametrize("architecture, config", [
    ("llama", transformers.LlamaConfig(**TINY_LLAMA)),
    ("gpt2", transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=64)),
])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_no_token_attends_across_a_packed_sample_boundary(architecture, config, attention):
    """float64, rows padded, the config's use_cache left true (the saved default), which without the guard makes
    transformers attend across samples: the packed rows' logits are those of the same rows under our own dense mask
    (each token sees its own sample's earlier tokens only), and each sample's are its logits alone; the same rows
    under a causal mask over the whole row (a leak) miss both by far more than the tolerance.

    Alone is float64-exact except under LLaMA's eager attention, whose softmax runs in float32 whatever the model's
    dtype (transformers' eager_attention_forward: softmax(..., dtype=torch.float32)). float32's softmax kernels round
    by the row's width and the sample's place in it (on AVX2, the 7 keys of a sample alone fit one 8-lane vector,
    its 12-key row does not): about 2e-8 in these logits. 8 float32 epsilons (1e-6) bound that with margin, and a
    leak moves them by about 0.2."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).double().eval()
    assert model.config.use_cache
    wrapped = HFLogits(model, "causal-lm")
    samples = [(torch.randint(0, 32, (n,)), torch.randint(0, 32, (n,))) for n in (5, 3, 7, 2, 6, 4)]
    lengths = torch.tensor([len(x) for x, _ in samples])
    dataset = Grouped(samples, Grouping("packed", 24, 12, lengths, 2))
    indices = torch.tensor([2, 0, 4, 1, 5, 3])
    inputs, targets = dataset.batch(indices)
    assert inputs["input_ids"].shape == (3, 12)  # rows of 12 in order (next fit): 7 + 5, 6 + 3, 4 + 2 (padded)
    rows = next_fit(lengths[indices].tolist(), 12)
    sample_of = torch.zeros((3, 12), dtype=torch.long)  # each token's sample in its row, the padding one of its own
    for row, members in enumerate(rows):
        sizes = lengths[indices[members]].tolist()
        sizes.append(12 - sum(sizes))  # the padding
        sample_of[row] = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    causal = torch.ones(12, 12, dtype=torch.bool).tril()

    def logits_under(allowed: torch.Tensor) -> torch.Tensor:  # allowed[row, i, j]: token i attends to token j
        mask = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
        return model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], attention_mask=mask[:, None],
                     use_cache=False).logits

    float32_softmax = architecture == "llama" and attention == "eager"
    tolerance = 8 * torch.finfo(torch.float32).eps if float32_softmax else 1e-12
    with torch.no_grad():
        packed = wrapped(inputs)
        torch.testing.assert_close(packed, logits_under(causal & (sample_of[:, :, None] == sample_of[:, None, :])),
                                   rtol=1e-12, atol=1e-12)
        leak = logits_under(causal.expand(3, 12, 12))
        for row, members in enumerate(rows):
            start = 0
            for member in members:
                tokens, target = samples[int(indices[member])]
                alone, span = wrapped(tokens[None])[0], slice(start, start + len(tokens))
                torch.testing.assert_close(packed[row, span], alone, rtol=tolerance, atol=tolerance)
                if start:  # a sample after another in its row: the leak would fail the comparison above
                    assert (leak[row, span] - alone).abs().max() > 1000 * tolerance
                assert torch.equal(targets[row, span], target)
                start += len(tokens)
            assert (targets[row, start:] == -100).all()
    check_packed(wrapped, torch.device("cpu"))  # the run's own check agrees


def test_packed_with_attention_over_the_whole_row_is_one_line():
    """The built-in GPT attends with is_causal over the whole row: packing would leak across samples."""
    recipe = llama_lora("packed")
    recipe["model"] = {"builtin": "gpt", "kwargs": {"vocab_size": 32, "block_size": 16, "layers": 1, "heads": 2,
                                                     "dim": 16}}
    spec, data, plan = grouped_plan(recipe)
    with pytest.raises(UserError) as error:
        train(plan, RunRequest("unused-out", device="cpu"), data=data)
    assert len(error.value.lines) == 1
    assert ("attention (GPT's own) or another of its layers (a convolution, a state-space layer) does not confine "
            "packed samples") in str(error.value)
    assert "data.packing: sorted" in str(error.value)


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_lora_run_with_each_way_is_the_large_batch_float64(way, tmp_path):
    """A LoRA run on variable-length sequences, grouped `way`: the weights of the plain large-batch loop over the
    same samples within float64 rounding, the paper's samples per step in the metrics, padding counted."""
    recipe = llama_lora(way, shuffle=False)
    spec, data, plan = grouped_plan(recipe)
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu"), dtype=torch.float64, data=data)
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    reference = run_plain(recipe, data, steps=3)
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, n=name: f"{n}: {m}")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [16, 16, 16]
    for record in records:
        assert record["micro_batches"] >= 1 and record["padded_tokens"] >= record["useful_tokens"] > 0
        assert record["useful_tokens_per_second"] > 0
    assert 0 <= summary["padding_fraction"] < 1 and summary["packing"] == way


def test_sorted_and_packed_pad_less_than_none(tmp_path):
    fractions = {}
    for way in ("none", "sorted", "packed"):
        recipe = llama_lora(way if way != "none" else None, effective=32, steps=2)
        spec, data, plan = grouped_plan(recipe, micro=8)
        fractions[way] = train(plan, RunRequest(tmp_path / way, device="cpu"), data=data)["padding_fraction"]
    assert fractions["packed"] < fractions["sorted"] < fractions["none"]


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_verify_says_equivalent_float64(way):
    spec, data, plan = grouped_plan(llama_lora(way, effective=16), micro=4)
    result = verify(plan, data=data)
    assert result.equivalent and result.global_relative_error < 1e-12, result.explanation
    assert any(f"data.packing {way}" in note for note in result.notes)


def test_a_token_budget_below_the_longest_example_is_one_line():
    spec, data, plan = grouped_plan(llama_lora("sorted", token_budget=5))
    with pytest.raises(UserError) as error:
        grouping_of(spec, data.train, plan.micro_batch)
    longest = max(len(x) for x, _ in data.train)
    assert str(error.value).startswith("data.token_budget: 5 tokens is smaller than example ")
    assert f"'s {longest} input tokens" in str(error.value)


@pytest.mark.parametrize("fields, expected", [
    ({"packing": "sorted", "builtin": "digits", "factory": None}, "data.packing: sorted groups samples by their "
     "lengths, which image data"),
    ({"token_budget": 64}, "data.token_budget: only used with data.packing sorted or packed"),
])
def test_packing_without_lengths_is_one_line(fields, expected):
    recipe = llama_lora()
    recipe["data"] = {k: v for k, v in {**recipe["data"], **fields}.items() if v is not None}
    if "builtin" in fields:
        recipe.update(task="classification", model={"builtin": "mlp"})
        recipe["data"]["format"] = "imagefolder"
        recipe["data"].pop("builtin")
        recipe["data"].update(available=False, image_size=8)
    with pytest.raises(UserError) as error:
        parse_recipe(recipe)
    assert expected in str(error.value)


def test_the_packing_option_is_checked_as_the_field():
    image = parse_recipe({"batch": {"effective": 8}, "task": "classification", "model": {"builtin": "mlp"},
                          "data": {"format": "imagefolder", "available": False, "image_size": 8},
                          "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 1}}})
    with pytest.raises(UserError, match=r"^--packing: data.packing: packed groups samples by their lengths, which "
                                        r"image data"):
        overlay(image, [Change("data.packing", "packed", "--packing")], "image.yaml")
    changes = [Change("data.packing", "sorted", "--packing"), Change("data.token_budget", 64, "--token-budget")]
    assert overlay(parse_recipe(llama_lora()), changes, "llama.yaml").data.token_budget == 64


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_micro_batch_mean_with_an_explicit_grouping_is_refused_in_one_line(way, tmp_path, capsys):
    """The mean of micro-batch means is defined on the paper's micro-batches of m samples: regrouped, it is neither
    the Trainer's update nor the exact window's; the field and --packing are refused alike, nothing written."""
    body = {**llama_lora(way), "loss": {"normalization": "micro-batch-mean"}}
    with pytest.raises(UserError, match=rf"^<recipe>: data.packing: {way} with loss.normalization micro-batch-mean: "):
        parse_recipe(body)
    body = {**llama_lora(), "loss": {"normalization": "micro-batch-mean"}}
    assert parse_recipe(body).data.packing is None and make_plan(parse_recipe(body), 4).recipe.data.packing is None
    path = tmp_path / "mean.yaml"
    path.write_text(yaml.safe_dump(body))
    out = tmp_path / "run"
    code, stdout, stderr = cli(capsys, "run", path, "--packing", way, "--micro-batch-max", "4", "--device", "cpu",
                               "--out", out)
    assert code == 2 and stdout == "" and not out.exists()
    assert stderr.startswith(f"error: --packing: data.packing: {way} with loss.normalization micro-batch-mean: "
                             "that mean is defined on the paper's micro-batches")
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert parse_recipe({**body, "data": {**body["data"], "packing": "none"}}).data.packing == "none"


def cli_command(recipe, out, *args: str) -> list[str]:
    return [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
            "--micro-batch-max", "4", "--checkpoint-every", "1", *args]


@pytest.mark.subprocess
@pytest.mark.parametrize("way", [pytest.param("sorted", marks=pytest.mark.slow), "packed"])
def test_sigkill_mid_window_then_resume_is_bitwise(way, tmp_path):
    """`--packing WAY` from the command line, killed (SIGKILL) while a step runs, resumed: the uninterrupted run's
    weights bit for bit, each step logged once."""
    shutil.copy(Path(__file__).parents[2] / "factories.py", tmp_path / "factories.py")  # the recipe's data, beside it
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(llama_lora(steps=8)))
    full = subprocess.run(cli_command(recipe, tmp_path / "full", "--packing", way), capture_output=True, text=True)
    assert full.returncode == 0, full.stderr
    out = tmp_path / "out"
    process = subprocess.Popen(cli_command(recipe, out, "--packing", way), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    resumed = subprocess.run(cli_command(recipe, out, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    ours, reference = (torch.load(folder / "model.pt", weights_only=True) for folder in (out, tmp_path / "full"))
    assert ours.keys() == reference.keys() and all(torch.equal(ours[n], reference[n]) for n in ours)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert yaml.safe_load((out / "plan.yaml").read_text())["recipe"]["data"]["packing"] == way


def instruction_recipe(sample_data, tmp_path, **data) -> Path:
    recipe = llama_lora(effective=16)
    recipe["model"]["kwargs"] = {**TINY_LLAMA, "max_position_embeddings": 512, "vocab_size": 512}
    recipe["data"] = {"format": "instructions", "path": str(sample_data / "instructions" / "train.jsonl"),
                      "tokenizer": str(sample_data / "tokenizer"), "max_length": 512, **data}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_plan_on_instruction_data_states_each_ways_padding(sample_data, tmp_path, capsys):
    """plan --data: the token budget, each way's micro-batches per window and padding, from the data's lengths."""
    recipe = instruction_recipe(sample_data, tmp_path)
    summary = cli_json(capsys, "plan", recipe, "--micro-batch-max", "4", "--packing", "sorted",
                       "--data", sample_data / "instructions" / "train.jsonl")
    table = summary["packing"]
    assert table["way"] == "sorted" and table["none"]["micro_batches"] == summary["accumulation_steps"] == 4
    assert table["none"]["padding_fraction"] > table["sorted"]["padding_fraction"] >= 0
    assert table["none"]["padding_fraction"] > table["packed"]["padding_fraction"] >= 0
    assert table["packed"]["micro_batches"] <= table["none"]["micro_batches"]
    assert not table["given"] and table["token_budget"] == 4 * table["longest"]  # the probed shape, m x L


def test_verify_from_the_command_line_with_packed_instruction_data(sample_data, tmp_path, capsys):
    recipe = instruction_recipe(sample_data, tmp_path)
    result = cli_json(capsys, "verify", recipe, "--micro-batch-max", "4", "--packing", "packed")
    assert result["equivalent"] and result["verdict"] == "equivalent"
    assert any(note.startswith("data.packing packed") for note in result["notes"])


INSTRUCTIONS = {"format": "instructions", "tokenizer": "tok", "max_length": 512, "available": False}


GPT = {"builtin": "gpt", "kwargs": {"vocab_size": 32, "block_size": 16, "layers": 1, "heads": 2, "dim": 16}}


@pytest.mark.parametrize(("data", "loss", "model", "expected"), [
    (INSTRUCTIONS, None, None, "packed"),  # instruction text, the loss over the window's tokens, transformers' LLaMA
    ({**INSTRUCTIONS, "format": "chat"}, None, None, "packed"),
    (INSTRUCTIONS, None, GPT, "sorted"),  # a model of its own attention: sorted, exact with any
    ({**INSTRUCTIONS, "packing": "none"}, None, None, "none"),  # the recipe's own way is kept
    ({**INSTRUCTIONS, "packing": "sorted"}, None, None, "sorted"),
    (INSTRUCTIONS, {"normalization": "micro-batch-mean"}, None, None),  # the paper's micro-batches: its arithmetic
    ({"factory": "factories:variable_lm"}, None, None, None),  # token sequences of a factory: not instruction data
])
def test_instruction_data_left_unset_plans_the_fastest_way_and_every_other_recipe_keeps_its_way(data, loss, model,
                                                                                                expected):
    body = llama_lora()
    body["data"] = data
    if loss:
        body["loss"] = loss
    if model:
        body["model"] = model
    recipe = parse_recipe(body)
    planned = make_plan(recipe, 4)
    assert planned.recipe.data.packing == expected
    assert default_packing(recipe) == (expected if "packing" not in data else None)
    # a plan saved before the default (data.packing unset: it ran `none`) keeps `none` when re-planned on resume
    old = planned.model_copy(update={"recipe": recipe})
    defaulted = expected in ("sorted", "packed") and "packing" not in data
    assert kept_grouping(recipe).data.packing == ("none" if defaulted else recipe.data.packing)
    assert replan(old, 2, None, 1000, "plan.yaml").recipe.data.packing == ("none" if defaulted else expected)


def test_the_shipped_recipes_take_packed_only_for_instruction_and_chat_data():
    papers = Path(__file__).parents[3] / "papers"
    ways = {path.name: default_packing(load_recipe(path)) for path in sorted(papers.glob("*.yaml"))}
    assert {name for name, way in ways.items() if way} == {
        "hu2021-lora-gpt2m-e2e.yaml", "taori2023-alpaca-7b.yaml", "tloen2023-alpaca-lora.yaml",
        "dettmers2023-qlora-guanaco-7b.yaml"}  # (the last two: window-tokens, their stated deviation)
    assert set(ways.values()) == {None, "packed"}  # (GPT-2 Medium and LLaMA-7B: transformers' models)


def test_the_plan_states_the_default_and_a_run_and_its_resume_keep_it(sample_data, tmp_path, capsys):
    """No --packing on instruction data: plan prints packed and why; the run packs (the paper's 16 samples a step
    in fewer micro-batches), plan.yaml keeps packed, and a resume keeps it (bitwise) and refuses another way."""
    recipe = instruction_recipe(sample_data, tmp_path)
    summary = cli_json(capsys, "plan", recipe, "--micro-batch-max", "4")
    table = summary["packing"]
    assert (table["way"], table["origin"]) == ("packed", DEFAULT_WHY) and table["packed"]["micro_batches"] < 4
    assert table["packed"]["padding_fraction"] == 0  # one row per micro-batch (the varlen attention)
    code, out, _ = cli(capsys, "plan", recipe, "--micro-batch-max", "4", "--packing", "none")
    assert code == 0 and "packing: none (data.packing, --packing)" in out
    code, out, _ = cli(capsys, "plan", recipe, "--micro-batch-max", "4")
    assert code == 0 and "packing: packed (the default for instruction and chat data" in " ".join(out.split())

    for out_dir, steps in (("full", "3"), ("part", "2")):
        code, _, err = cli(capsys, "run", recipe, "--out", tmp_path / out_dir, "--device", "cpu",
                           "--micro-batch-max", "4", "--max-steps", steps)
        assert code == 0, err
    saved = yaml.safe_load((tmp_path / "part" / "plan.yaml").read_text())
    assert saved["recipe"]["data"]["packing"] == "packed"
    code, _, err = cli(capsys, "run", recipe, "--out", tmp_path / "part", "--device", "cpu", "--resume",
                       "--packing", "none")
    assert code == 2 and "--packing: the run in " in err and "was started with data.packing packed" in err
    code, _, err = cli(capsys, "run", recipe, "--out", tmp_path / "part", "--device", "cpu", "--resume")
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [16] * 3 and sum(r["micro_batches"] for r in records) < 3 * 4
    ours, reference = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("part", "full"))
    assert all(torch.equal(ours[n], reference[n]) for n in reference)


@pytest.mark.distributed
@pytest.mark.subprocess
# sorted: slow (16 s); its per-rank grouping is test_each_steps_sample_ids_are_the_unpacked_plans_on_every_rank's,
# its exactness test_lora_run_with_each_way_is_the_large_batch_float64's, the two-process path packed's
@pytest.mark.parametrize("way", [pytest.param("sorted", marks=pytest.mark.slow), "packed"])
def test_two_processes_group_their_shares_and_give_the_large_batch(way, tmp_path):
    """Two DDP processes (gloo), partial windows included (drop_last false: 48 samples, 20 a step): each rank
    groups its own share, both run as many backward passes (one gradient reduction a step), and the weights are
    the plain large-batch loop's over the same samples."""
    recipe = llama_lora(way, effective=20, steps=3, shuffle=False, drop_last=False)
    reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "2", "--nproc-per-node", "2")
    data = build_data(parse_recipe(recipe))
    reference = run_plain(recipe, data, steps=3, dtype=torch.float32)  # an epoch: 20, 20, then the partial 8
    ours = torch.load(tmp_path / "two" / "model.pt", weights_only=True)
    assert ours.keys() == reference.keys()
    for name in ours:  # float32, summed over two processes in another order
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-5, atol=1e-6)
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records] == [20, 20, 8] and records[2]["partial"]
    assert all(r["grad_syncs"] == 1 for r in records)
    assert records[0]["micro_batches"] < 5  # fewer than the 5 micro-batches of 2 a rank `none` runs


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_an_empty_micro_batch_brings_no_loss_but_reaches_every_trained_parameter(way):
    """What a rank with fewer samples than micro-batches runs (`balance`): one padding token without a target. Its
    loss is 0 and every trained parameter gets a gradient of zeros, so DDP's reduction sees the same parameters on
    every rank and the window's gradient is unchanged."""
    from reproduce.models import build_model
    from reproduce.train.losses import TokenLoss

    spec, data, plan = grouped_plan(llama_lora(way))
    grouping = grouping_of(spec, data.train, plan.micro_batch)
    torch.manual_seed(0)
    model = build_model(spec, data.info)
    inputs, targets = Grouped(data.train, grouping).batch(torch.empty(0, dtype=torch.long))
    loss = TokenLoss()(model(inputs), targets)
    loss.backward()
    assert float(loss.detach()) == 0.0 and TokenLoss().count(targets) == 0
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and not p.grad.any() for p in trained)


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_a_micro_batch_lowered_after_out_of_memory_lowers_the_token_budget_and_keeps_the_samples(way):
    spec, data, plan = grouped_plan(llama_lora(way, effective=16), micro=4)
    grouping = grouping_of(spec, data.train, plan.micro_batch)
    size = len(data.train)
    full, _ = window(plan, size, 0, 3, grouping=grouping)
    lowered, _ = window(plan, size, 0, 3, micro_batch=2, grouping=grouping)
    assert grouping.budget_at(2) == grouping.budget // 2
    assert sorted(torch.cat(lowered).tolist()) == sorted(torch.cat(full).tolist())
    assert len(lowered) > len(full)
    for indices in lowered:
        lengths = grouping.lengths[indices].tolist()
        computed = (len(lengths) * max(lengths) if way == "sorted"
                    else len(next_fit(lengths, grouping.row)) * grouping.row)
        assert computed <= grouping.budget // 2 or len(lengths) == 1


@pytest.mark.parametrize("way", ["none", "sorted", "packed"])
def test_the_throughput_policy_times_windows_grouped_as_the_run_groups_them(way, one_thread):
    """--policy throughput's steps (throughput/split_steps.py): each window of split m grouped as the run groups it
    (T = m x the longest example), through the run's attention (varlen for packed), and timed."""
    from reproduce.probe.workload import Workload
    from reproduce.throughput.split_steps import SplitSteps

    steps = SplitSteps(Workload(parse_recipe(llama_lora(way if way != "none" else None, effective=8))),
                       torch.device("cpu"), 8, noise_scale=False)
    try:
        window = steps.window(4)
        indices = steps.order[:8]
        if way == "none":
            assert steps.grouping is None and [m.indices.tolist() for m in window] == [indices[:4].tolist(),
                                                                                       indices[4:].tolist()]
        else:
            assert steps.grouping.way == way and steps.grouping.varlen is (way == "packed")
            expected = group(indices, steps.grouping, 4 * int(steps.grouping.lengths.max()))
            assert [m.indices.tolist() for m in window] == [g.tolist() for g in expected]
            assert isinstance(steps.dataset, Grouped)
        assert steps(4, 1) > 0
    finally:
        steps.close()


@pytest.mark.parametrize("way", ["sorted", "packed"])
def test_the_run_says_at_its_start_how_it_groups_and_what_it_pads(way, tmp_path):
    """The first line of a grouped run: the way, T, the attention, and the padding share of its first windows, as
    the run's own metrics then count it (packed through the varlen attention: no padding at all)."""
    from reproduce.train.reporter import SilentReporter

    said: list[str] = []

    class Lines(SilentReporter):
        def message(self, text: str) -> None:
            said.append(text)

    spec, data, plan = grouped_plan(llama_lora(way, effective=16, steps=2))
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu"), data=data, reporter=Lines())
    line = next(text for text in said if text.startswith("packing: "))
    budget = 4 * max(len(x) for x, _ in data.train)
    assert line.startswith(f"packing: {way}, token budget {budget:,} tokens per micro-batch, ")
    assert "over the first 2 windows: " in line
    padding = int(line.rsplit(", ", 1)[1].split("%")[0])
    assert padding == round(100 * summary["padding_fraction"])
    assert ("varlen attention" in line and padding == 0) if way == "packed" else "rows padded" in line
