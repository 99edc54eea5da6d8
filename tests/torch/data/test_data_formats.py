"""Data on disk (`data.format` with `--data`), fed by DataLoader workers: every format trains from the CLI, the
token file gives a plain loop's weights, instruction data masks exactly the prompt, resume with workers is
bitwise. The data is made here (`reproduce.data.samples`, the `sample_data` fixture), never downloaded."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from helpers import assert_same_model, data_paths
from reproduce.cli import main
from reproduce.data import build_data
from reproduce.data.batches import LazyMicroBatch
from reproduce.data.loader import LoaderWatch, window_keys
from reproduce.models import build_model
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe
from reproduce.train.setup import build
from reproduce.train.step import optimizer_step
from reproduce.train.trainer import RunRequest, read_metrics, train
from reproduce.train.windows import window

ADAMW = {"name": "adamw", "lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}
SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}
TINY_GPT = {"layers": 1, "heads": 2, "dim": 32, "dropout": 0.0}


def recipe_for(fmt: str, root: Path, **data) -> dict:
    """A small recipe reading `fmt` data (paths come from --data, or with_data_paths)."""
    if fmt == "imagefolder":
        return {"batch": {"effective": 32}, "task": "classification", "model": {"builtin": "mlp"},
                "data": {"format": "imagefolder", "available": False, "image_size": 8, "channels": 1, **data},
                "optimizer": SGD, "schedule": {"total": {"steps": 6}}}
    if fmt == "tokens":
        return {"batch": {"effective": 512, "unit": "tokens", "sequence_length": 32}, "task": "language-modeling",
                "model": {"builtin": "gpt", "kwargs": {**TINY_GPT, "vocab_size": 512}},
                "data": {"format": "tokens", "available": False, **data},
                "optimizer": ADAMW, "schedule": {"total": {"steps": 4}}}
    if fmt == "digits-parquet":
        return {"batch": {"effective": 32}, "task": "classification", "model": {"builtin": "mlp"},
                "data": {"format": "hf-datasets", "available": False, "columns": {"input": "pixels", "label": "label"},
                         **data},
                "optimizer": SGD, "schedule": {"total": {"steps": 6}}}
    text = {"format": fmt, "available": False, "tokenizer": str(root / "tokenizer"), "max_length": 128}
    if fmt == "hf-datasets":
        text["columns"] = {"instruction": "instruction", "input": "input", "output": "output"}
    return {"batch": {"effective": 8}, "task": "language-modeling",
            "model": {"builtin": "gpt", "kwargs": {**TINY_GPT, "block_size": 128}},
            "data": {**text, **data}, "optimizer": ADAMW, "schedule": {"total": {"steps": 4}}}


CLI_CASES = {
    # id: (format, --data, --eval-data, --micro-batch-max, --workers, expected workers)
    "imagefolder": ("imagefolder", "images/train", "images/val", 8, "1", 1),
    "tokens": ("tokens", "tokens", None, 4, "1", 1),  # a nanoGPT folder: train.bin, and val.bin to evaluate
    "instructions": ("instructions", "instructions/train.jsonl", "instructions/val.jsonl", 2, None, 0),
    "hf-datasets-saved": ("hf-datasets", "hf/instructions", None, 2, "1", 1),  # the validation split evaluates
    "hf-datasets-parquet": ("digits-parquet", "hf/digits-train.parquet", "hf/digits-val.parquet", 8, None, 0),
}


@pytest.mark.parametrize("case", list(CLI_CASES), ids=list(CLI_CASES))
def test_each_format_trains_from_the_cli(case, sample_data, tmp_path, capsys):
    fmt, data, eval_data, micro, workers, expected_workers = CLI_CASES[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for(fmt, sample_data, **({"augment": "imagenet"} if fmt == "imagefolder"
                                                                       else {}))))
    out = tmp_path / "out"
    args = ["run", str(recipe), "--out", str(out), "--device", "cpu", "--micro-batch-max", str(micro),
            "--max-steps", "3", "--data", str(sample_data / data)]
    args += ["--eval-data", str(sample_data / eval_data)] if eval_data else []
    args += ["--workers", workers] if workers else []
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 0, captured.err
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 <= r["data_seconds"] <= r["seconds"] and np.isfinite(r["loss"]) for r in records)
    assert "eval_loss" in records[-1]  # the evaluation data was read too
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data"]["format"] == fmt.replace("digits-parquet", "hf-datasets")
    assert summary["workers"] == expected_workers
    saved = yaml.safe_load((out / "plan.yaml").read_text())["recipe"]["data"]
    assert saved["path"] == str(sample_data / data)  # the run's data is in its plan, for --resume and verify


def test_tokens_without_shuffle_equal_a_plain_loop_float64(sample_data, tmp_path):
    """Sample i is tokens [i*T, (i+1)*T] with the span shifted by one as targets; accumulated over 4 micro-batches
    fetched by 2 workers, the weights are those of one plain pass per window of 16 sequences."""
    spec = data_paths(parse_recipe(recipe_for("tokens", sample_data, shuffle=False)),
                           str(sample_data / "tokens" / "train.bin"), None)
    data = build_data(spec)
    plan = make_plan(spec, micro_batch_max=4, dataset_size=len(data.train))
    assert (plan.micro_batch, plan.accumulation_steps) == (4, 4)
    train(plan, RunRequest(tmp_path / "run", device="cpu", workers=2), dtype=torch.float64, data=data)
    ours = torch.load(tmp_path / "run" / "model.pt", weights_only=True)

    tokens = torch.from_numpy(np.fromfile(sample_data / "tokens" / "train.bin", dtype=np.uint16).astype(np.int64))
    torch.manual_seed(spec.seed)
    model = build_model(spec, data.info).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr, betas=spec.optimizer.betas,
                                  eps=spec.optimizer.eps, weight_decay=spec.optimizer.weight_decay)
    length, sequences = 32, 16
    for step in range(4):
        spans = torch.stack([tokens[i * length:(i + 1) * length + 1]
                             for i in range(step * sequences, (step + 1) * sequences)])
        loss = F.cross_entropy(model(spans[:, :-1]).flatten(0, 1), spans[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    reference = model.state_dict()
    assert ours.keys() == reference.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-6, atol=1e-12)
    initial = build_model(spec, data.info).state_dict()
    assert any(not torch.allclose(initial[k].double(), ours[k]) for k in ours)  # the weights moved
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["tokens"] == 512 for r in records)


ALPACA_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n"
                     "### Input:\n{}\n\n### Response:")
ALPACA_WITHOUT_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                        "completes the request.\n\n### Instruction:\n{}\n\n### Response:")


def test_instruction_data_masks_exactly_the_prompt_tokens(sample_data, tmp_path):
    from transformers import AutoTokenizer

    spec = data_paths(parse_recipe(recipe_for("instructions", sample_data, shuffle=False)),
                           str(sample_data / "instructions" / "train.jsonl"), None)
    data = build_data(spec)
    dataset = data.train
    tokenizer = AutoTokenizer.from_pretrained(str(sample_data / "tokenizer"), local_files_only=True)
    records = [json.loads(line) for line in (sample_data / "instructions" / "train.jsonl").read_text().splitlines()]
    assert len(dataset) == len(records)
    assert {bool(r["input"]) for r in records[:60]} == {True, False}  # both of Alpaca's templates are checked
    for index, record in enumerate(records[:60]):
        prompt = (ALPACA_WITH_INPUT.format(record["instruction"], record["input"]) if record["input"]
                  else ALPACA_WITHOUT_INPUT.format(record["instruction"]))
        full = tokenizer(prompt + record["output"] + tokenizer.eos_token, truncation=True, max_length=128)
        ids, prompt_ids = full["input_ids"], tokenizer(prompt)["input_ids"]
        inputs, targets = dataset[index]
        assert inputs.tolist() == ids[:-1]
        assert ids[: len(prompt_ids)] == prompt_ids[: len(ids)]  # the prompt's tokens open the sequence
        for position, target in enumerate(targets.tolist()):  # target t is the token after input t
            if position + 1 < len(prompt_ids):
                assert target == -100, (index, position)  # a prompt token: no loss
            else:
                assert target == ids[position + 1], (index, position)  # a response token: its id
        if len(ids) < 128:  # not truncated: the loss-bearing tokens are exactly the output and EOS
            assert tokenizer.decode(ids[len(prompt_ids):]) == record["output"] + tokenizer.eos_token
        assert int(dataset.target_counts(torch.tensor([index]))) == int((targets != -100).sum())

    # the window's count, known before the first backward, is the response tokens of its samples
    plan = make_plan(spec, micro_batch_max=2, dataset_size=len(dataset))
    train(plan, RunRequest(tmp_path / "run", device="cpu", max_steps=2, workers=1), data=data)
    records_out = read_metrics(tmp_path / "run" / "metrics.jsonl")
    for step, record in enumerate(records_out):
        window_targets = [dataset[i][1] for i in range(step * 8, (step + 1) * 8)]
        assert record["items"] == record["tokens"] == sum(int((t != -100).sum()) for t in window_targets)


def test_window_count_is_known_before_any_micro_batch_is_fetched(sample_data):
    """Counted from the cached per-sample counts: no micro-batch is loaded before the count (so before the first
    backward), and each is loaded just before its own forward."""
    spec = data_paths(parse_recipe(recipe_for("instructions", sample_data, shuffle=False)),
                           str(sample_data / "instructions" / "train.jsonl"), None)
    data = build_data(spec)
    dataset, events = data.train, []
    counts = dataset.target_counts

    def counted(indices):
        events.append("count")
        return counts(indices)

    dataset.target_counts = counted
    plan = make_plan(spec, micro_batch_max=2, dataset_size=len(dataset))
    setup = build(plan, torch.device("cpu"), data=data)
    original_forward = setup.model.forward

    def forward(inputs):
        events.append("forward")
        return original_forward(inputs)

    setup.model.forward = forward

    def source(indices):
        events.append("load")
        return dataset.batch(indices) if hasattr(dataset, "batch") else _collate(dataset, indices)

    indices, _ = window(plan, len(dataset), 0, spec.seed)
    micro_batches = [LazyMicroBatch(dataset, i, setup.device, setup.dtype, source) for i in indices]
    optimizer_step(setup, micro_batches)
    assert events == ["count"] * 4 + ["load", "forward"] * 4


def _collate(dataset, indices):
    from reproduce.data.batches import collate

    return collate([dataset[int(i)] for i in indices])


def test_resume_with_workers_is_bitwise_mid_epoch(sample_data, tmp_path):
    """ImageNet augmentation (random crops and flips) and dropout: a run stopped after 3 of 6 steps (44 steps an
    epoch) and resumed, with 2 then 1 workers, gives bitwise the weights of an uninterrupted run without workers."""
    recipe = recipe_for("imagefolder", sample_data, augment="imagenet", shuffle=True)
    recipe["model"] = {"builtin": "mlp", "kwargs": {"dropout": 0.3}}
    spec = data_paths(parse_recipe(recipe), str(sample_data / "images" / "train"), None)
    data = build_data(spec)
    plan = make_plan(spec, micro_batch_max=8, dataset_size=len(data.train))
    assert plan.steps_per_epoch == 44
    train(plan, RunRequest(tmp_path / "full", device="cpu", workers=0), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=3, workers=2), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True, workers=1), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")
    losses = [r["loss"] for r in read_metrics(tmp_path / "split" / "metrics.jsonl")]
    assert losses == [r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")] and len(losses) == 6


def test_resume_reads_the_runs_own_data_and_refuses_other_data(sample_data, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(recipe_for("tokens", sample_data)))
    out = tmp_path / "out"
    base = ["run", str(recipe), "--out", str(out), "--device", "cpu", "--micro-batch-max", "4"]
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--data", str(sample_data / "tokens"), "--max-steps", "2"])
    assert exit_info.value.code == 0
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--resume", "--data", str(sample_data / "tokens" / "val.bin")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"--data: the run in {out} was started with data.path {sample_data / 'tokens'}; " in err  # the folder
    with pytest.raises(SystemExit) as exit_info:
        main([*base, "--resume"])  # no --data: the run's own, from its plan.yaml
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3, 4]


def test_sampler_yields_the_windows_micro_batches_in_order():
    spec = parse_recipe({"batch": {"effective": 24}, "task": "classification", "model": {"builtin": "mlp"},
                         "data": {"builtin": "digits"}, "optimizer": SGD, "schedule": {"total": {"steps": 100}}})
    plan = make_plan(spec, micro_batch_max=8, dataset_size=100)
    keys = list(window_keys(lambda step: window(plan, 100, step, 7, 0, 6)[0], 2, 6))
    expected = [(step, tuple(i.tolist())) for step in range(2, 6) for i in window(plan, 100, step, 7, 0, 6)[0]]
    assert keys == expected and len(keys) == 4 * 4  # micro-batch 6: 4 per window
    assert keys[-1][0] == 5 and len({indices for _, indices in keys[:8]}) == 8  # epoch 1 starts at step 4: reshuffled


def test_the_run_warns_once_when_the_loader_is_the_bottleneck(tmp_path):
    class Messages:
        def __init__(self):
            self.lines = []

        def start(self, *args): ...
        def step(self, record): ...
        def finish(self, summary): ...

        def message(self, text):
            self.lines.append(text)

    spec = parse_recipe({"batch": {"effective": 32}, "task": "classification", "model": {"builtin": "mlp"},
                         "data": {"factory": "factories:slow_digits", "kwargs": {"delay": 0.003}},
                         "optimizer": SGD, "schedule": {"total": {"steps": 5}}, "evaluation": {"at_end": False}})
    data = build_data(spec)
    plan = make_plan(spec, micro_batch_max=8, dataset_size=len(data.train))
    reporter = Messages()
    train(plan, RunRequest(tmp_path / "run", device="cpu", workers=0), data=data, reporter=reporter)
    warnings = [line for line in reporter.lines if "the loader is the bottleneck" in line]
    assert len(warnings) == 1 and "with `workers` 0" in warnings[0], reporter.lines  # the field; the CLI: --workers
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert all(r["data_seconds"] >= 32 * 0.003 for r in records)  # 32 items of 3 ms each step

    watch = LoaderWatch(workers=4)  # and it stays quiet while the steps do not wait
    assert [watch.update(step, 0.001, 0.1) for step in range(1, 10)] == [None] * 9


def test_hf_datasets_image_column_decodes_and_transforms_each_row(sample_data):
    """Parquet rows of PNG bytes and labels: the same images, labels and transforms as the image folder."""
    import pyarrow.parquet as pq

    recipe = recipe_for("digits-parquet", sample_data, augment="none", image_size=8, channels=1)
    recipe["data"]["columns"] = {"image": "image", "label": "label"}
    spec = data_paths(parse_recipe(recipe), str(sample_data / "hf" / "digits-train.parquet"),
                           str(sample_data / "hf" / "digits-val.parquet"))
    data = build_data(spec)
    labels = pq.read_table(sample_data / "hf" / "digits-train.parquet").column("label").to_pylist()
    assert len(data.train) == len(labels) == 1437 and len(data.eval) == 360
    assert data.info["classes"] == 10
    folder = build_data(data_paths(parse_recipe(recipe_for("imagefolder", sample_data, augment="none")),
                                        str(sample_data / "images" / "train"), None)).train
    for index in (0, 700, 1436):  # the parquet rows and the PNG files hold the same digits, in the same order
        image, label = data.train[index]
        assert image.shape == (1, 8, 8) and int(label) == labels[index]
        same = [i for i, (path, target) in enumerate(folder.samples) if path.endswith(f"{index:04d}.png")]
        assert len(same) == 1 and folder.samples[same[0]][1] == labels[index]
        torch.testing.assert_close(folder[same[0]][0], image)


def test_build_data_types_the_dict_a_factory_returns():
    """A factory returns a dict with "train" (and optionally "eval" and "info"); the run, the probe and verify get a
    frozen `Datasets`, whose info names the factory when the factory gave none."""
    from dataclasses import FrozenInstanceError

    from helpers import SGD, data_of, digits_recipe
    from reproduce.data import Datasets

    bare = data_of({**digits_recipe(SGD), "data": {"factory": "factories:train_only_digits", "shuffle": False}})
    assert isinstance(bare, Datasets) and bare.eval is None and bare.info == {"name": "factories:train_only_digits"}
    assert len(bare.train) == 1437
    with pytest.raises(FrozenInstanceError):
        bare.eval = bare.train
    builtin = data_of(digits_recipe(SGD))
    assert (len(builtin.train), len(builtin.eval), builtin.info["name"]) == (1437, 360, "digits")
