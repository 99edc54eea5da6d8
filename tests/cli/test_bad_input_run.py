"""Bad input to `reproduce run`: exit 2, one clear line naming the file or option and the field, no traceback,
and the output folder left exactly as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from helpers import snapshot
from reproduce.cli import main

RUNNABLE = {
    "batch": {"effective": 64},
    "task": "classification",
    "model": {"builtin": "mlp"},
    "data": {"builtin": "digits"},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"total": {"steps": 3}},
}


def changed(**changes) -> dict:
    data = yaml.safe_load(yaml.safe_dump(RUNNABLE))
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = data
        for part in parents:
            node = node[part]
        node[last] = value
    return data


CASES = [
    # (id, recipe dict, extra args, expected substring)
    ("builtin-model-unknown", changed(model={"builtin": "resnet51"}), [],
     "model.builtin: no built-in 'resnet51' to run here"),
    ("architecture-takes-other-images", changed(model={"builtin": "resnet50"}), [],
     "data.channels: resnet50 takes 3-channel images (got 1)"),
    ("architecture-setting-unknown", changed(model={"builtin": "gpt2-124m", "kwargs": {"n_layr": 1}}), [],
     "model.kwargs: gpt2-124m has no setting 'n_layr' (did you mean 'n_layer'?)"),
    ("lora-target-not-in-the-model", changed(model={"builtin": "mlp", "lora": {"r": 2, "target_modules": "c_attn"}}),
     [], "model.lora.target_modules: mlp has no module named 'c_attn' (modules LoRA can adapt: 1, 4, 6)"),
    ("data-not-available", changed(data={"name": "imagenet-1k", "available": False}), [],
     "data: 'imagenet-1k' is marked available: false"),
    ("factory-module-missing", changed(model={"factory": "no_such_pkg.models:net"}), [],
     "model.factory: cannot import 'no_such_pkg.models'"),
    ("factory-function-missing", changed(model={"factory": "json:no_such_function"}), [],
     "model.factory: 'json' has no function 'no_such_function'"),
    ("factory-returns-wrong-kind", changed(model={"factory": "json:dumps", "kwargs": {"obj": 1}}), [],
     "model: the factory must return a torch.nn.Module (got str)"),
    ("factory-rejects-kwargs", changed(model={"builtin": "mlp", "kwargs": {"wings": 2}}), [],
     "model.kwargs: mlp rejected its arguments"),
    ("factory-rejects-a-negative-size", changed(model={"builtin": "mlp", "kwargs": {"hidden": -5}}), [],
     "model.kwargs: mlp rejected its arguments: Trying to create tensor with negative dimension -5"),
    ("factory-cannot-allocate-its-size", changed(model={"builtin": "mlp", "kwargs": {"hidden": 10**13}}), [],
     "model.kwargs: mlp rejected its arguments: "),
    ("architecture-rejects-a-negative-size",
     changed(model={"builtin": "gpt2-124m", "kwargs": {"n_embd": -8, "n_layer": 1}}), [],
     "model.kwargs: gpt2-124m rejected its arguments: "),
    ("data-factory-wrong-kind", changed(data={"factory": "json:dumps", "kwargs": {"obj": 1}}), [],
     "data: the factory must return a dict with a 'train' dataset"),
    ("phases-data-cannot-be-cut",
     changed(task="language-modeling", batch={"effective": 4, "sequence_length": 16, "phases": [
         {"steps": 1, "effective": 4, "sequence_length": 8}, {"effective": 4}]},
         model={"factory": "factories:tiny_gpt"}, data={"factory": "factories:variable_lm"}), [],
     "batch.phases: sequence length 8 differs from batch.sequence_length 16, but the training data "
     "(factories:variable_lm, list) cannot be cut at another length"),
    ("phase-epoch-shorter-than-a-step",
     changed(batch={"effective": 64, "phases": [{"steps": 1, "effective": 64}, {"effective": 4096}]}),
     ["--micro-batch-max", "64"], "data: the epoch (1437 samples) is shorter than one optimizer step (4096)"),
    ("epoch-shorter-than-a-step", changed(batch={"effective": 4096}), ["--micro-batch-max", "64"],
     "data: the epoch (1437 samples) is shorter than one optimizer step (4096)"),
    ("world-size-beyond-batch", RUNNABLE, ["--world-size", "65"], "--world-size: 65 processes exceed"),
    ("micro-batch-max-zero", RUNNABLE, ["--micro-batch-max", "0"], "--micro-batch-max"),
    ("world-size-zero", RUNNABLE, ["--world-size", "0"], "--world-size"),
    ("bad-device", RUNNABLE, ["--device", "tpu"], "--device: expected cpu, cuda or auto (got 'tpu')"),
    ("max-steps-zero", RUNNABLE, ["--max-steps", "0"], "--max-steps"),
    ("resume-without-checkpoint", RUNNABLE, ["--resume"], "--resume:"),
    ("several-nodes-without-rendezvous", RUNNABLE, ["--nproc-per-node", "2", "--nnodes", "2"],
     "--rdzv-endpoint: required"),
    ("elastic-nodes-without-rendezvous", RUNNABLE, ["--nproc-per-node", "1", "--nnodes", "1:2"],
     "--rdzv-endpoint: required"),
    ("nodes-not-a-number", RUNNABLE, ["--nproc-per-node", "1", "--nnodes", "2:x"],
     "--nnodes: expected a number of machines N or an elastic range MIN:MAX (got '2:x')"),
    ("no-noise-scale-takes-no-value", RUNNABLE, ["--no-noise-scale=yes"],
     "Option '--no-noise-scale' does not take a value"),
    # FSDP: checked before anything is launched or written
    ("fsdp-on-one-process", RUNNABLE, ["--sharding", "fsdp"],
     "batch.sharding: fsdp shards the model over several processes, but this run has 1; add --nproc-per-node"),
    ("recipe-fsdp-on-one-process", changed(batch={"effective": 64, "sharding": "fsdp"}), [],
     "batch.sharding: fsdp shards the model over several processes, but this run has 1"),
    ("fsdp-on-one-launched-process", RUNNABLE, ["--sharding", "fsdp", "--nproc-per-node", "1"],
     "batch.sharding: fsdp shards the model over several processes, but this run has 1"),
    ("fsdp-optimizer-it-cannot-shard", changed(optimizer={"name": "adafactor", "lr": 0.01}),
     ["--sharding", "fsdp", "--nproc-per-node", "2"],
     "optimizer.name: adafactor cannot step FSDP's sharded parameters exactly"),
    ("fsdp-real-probe", RUNNABLE, ["--sharding", "fsdp", "--nproc-per-node", "2", "--meter", "cpu", "--memory",
                                   "1GiB", "--no-micro-batch-max"],
     "--micro-batch-max: with --sharding fsdp give it (or --meter estimate)"),
    ("sharding-unknown", RUNNABLE, ["--sharding", "zero3"], "'zero3' is not one of 'none', 'fsdp'"),
]


@pytest.mark.parametrize("case_id, recipe, args, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_run_input(case_id, recipe, args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file, which must survive\n")
    before = snapshot(out)
    if "--no-micro-batch-max" in args:  # the case is about the probe
        args = [a for a in args if a != "--no-micro-batch-max"]
    elif "--micro-batch-max" not in args:
        args = [*args, "--micro-batch-max", "16"]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(out), "--device", "cpu", *args, "--force"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err
    assert "Traceback" not in err
    assert snapshot(out) == before


def test_a_folder_of_the_users_own_files_is_named_not_called_a_run(tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RUNNABLE))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(out), "--device", "cpu", "--micro-batch-max", "16"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"--out: {out} is not empty (it holds notes.txt, not a run of reproduce)" in err
    assert "another run" not in err and "--resume" not in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_device_cuda_without_a_gpu(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RUNNABLE))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(path), "--out", str(tmp_path / "out"), "--device", "cuda", "--micro-batch-max", "16"])
    assert exit_info.value.code == 2
    assert "--device: cuda was asked for, but torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_edited_into_inconsistency_is_refused_by_run(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RUNNABLE))
    plan_path = tmp_path / "plan.yaml"
    with pytest.raises(SystemExit):
        main(["plan", str(recipe), "--micro-batch-max", "16", "--out", str(plan_path)])
    data = yaml.safe_load(plan_path.read_text())
    data["split"]["accumulation_steps"] = 3  # 16 x 3 x 1 != 64
    plan_path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(plan_path), "--out", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (f"error: {plan_path}: split.effective_batch: micro_batch x accumulation_steps x world_size = 16 x 3 x 1"
            in err)
    assert not (tmp_path / "out").exists()


def test_resume_with_a_changed_recipe_is_refused(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RUNNABLE))
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--micro-batch-max", "16"])
    before = snapshot(out)
    recipe.write_text(yaml.safe_dump(changed(optimizer={"name": "sgd", "lr": 0.5})))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--resume"])
    assert exit_info.value.code == 2
    assert "--resume: the recipe in" in capsys.readouterr().err
    assert snapshot(out) == before


def test_resume_with_another_sharding_is_refused(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RUNNABLE))
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--micro-batch-max", "16", "--max-steps", "1"])
    before = snapshot(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(recipe), "--out", str(out), "--device", "cpu", "--resume", "--sharding", "fsdp",
              "--nproc-per-node", "2"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.strip() == (f"error: --sharding: the run in {out} was started with batch.sharding none; resume it as "
                           "it was started (its plan.yaml keeps batch.sharding; got fsdp)")
    assert snapshot(out) == before


# ---- data on disk (data.format with --data): the file and what was expected, before anything is written ----

def _recipe(kind: str) -> dict:
    optimizer, schedule = {"name": "sgd", "lr": 0.1}, {"total": {"steps": 2}}
    if kind == "images":
        return {"batch": {"effective": 4}, "task": "classification", "model": {"builtin": "mlp"},
                "data": {"format": "imagefolder", "available": False, "image_size": 8, "channels": 1,
                         "augment": "none"}, "optimizer": optimizer, "schedule": schedule}
    language = {"task": "language-modeling", "optimizer": optimizer, "schedule": schedule,
                "model": {"builtin": "gpt", "kwargs": {"layers": 1, "heads": 1, "dim": 8, "block_size": 32}}}
    if kind == "tokens":
        return {**language, "batch": {"effective": 32, "unit": "tokens", "sequence_length": 8},
                "data": {"format": "tokens", "available": False}}
    if kind == "hf-text":
        return {**language, "batch": {"effective": 4}, "data": {"format": "hf-datasets", "available": False,
                "columns": {"text": "content"}, "tokenizer": "./tok", "max_length": 32}}
    return {**language, "batch": {"effective": 4},
            "data": {"format": "instructions", "available": False, "tokenizer": "./tok", "max_length": 32}}


def _png(path: Path) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), 128).save(path)


GOOD_RECORD = '{"instruction": "Say hi.", "input": "", "output": "hi"}\n'
DATA_CASES = [
    # (id, recipe kind, files to make: path -> bytes, or None for a folder, or "png"; args; expected)
    ("image-folder-missing", "images", {}, ["--data", "nowhere"], "data.path: {tmp}/nowhere: no such folder"),
    ("image-folder-is-a-file", "images", {"train.tar": b"x"}, ["--data", "train.tar"],
     "train.tar: is a file; expected a folder with one sub-folder of images per class"),
    ("image-folder-empty", "images", {"train": None}, ["--data", "train"], "train: no class sub-folders"),
    ("image-classes-without-images", "images", {"train/cat": None, "train/dog/notes.txt": b"x"},
     ["--data", "train"], "train: no image files in its class folders"),
    ("image-eval-class-unknown", "images", {"train/cat/1.png": "png", "val/dog/1.png": "png"},
     ["--data", "train", "--eval-data", "val"],
     "data.eval_path: {tmp}/val: class folder 'dog' is not among the training data's 1 classes"),
    ("tokens-not-whole-tokens", "tokens", {"train.bin": bytes(1001)}, ["--data", "train.bin"],
     "data.path: {tmp}/train.bin: 1001 bytes is not a whole number of uint16 tokens (2 bytes each)"),
    ("tokens-fewer-than-a-sample", "tokens", {"train.bin": bytes(10)}, ["--data", "train.bin"],
     "train.bin: 5 tokens, fewer than one sample of sequence_length 8 + 1"),
    ("tokens-folder-without-train-bin", "tokens", {"shakespeare/input.txt": b"x"}, ["--data", "shakespeare"],
     "shakespeare: a folder without train.bin"),
    ("tokens-eval-missing", "tokens", {"train.bin": bytes(200)}, ["--data", "train.bin", "--eval-data", "val.bin"],
     "data.eval_path: {tmp}/val.bin: no such file (expected a binary file of uint16 token ids)"),
    ("instructions-line-not-an-object", "instructions", {"a.jsonl": (GOOD_RECORD + "[1, 2]\n").encode()},
     ["--data", "a.jsonl"], "a.jsonl: line 2: expected a JSON object with instruction, input, output (got list)"),
    ("instructions-line-not-json", "instructions", {"a.jsonl": b"{'instruction': 1}\n"}, ["--data", "a.jsonl"],
     "a.jsonl: line 1: not valid JSON"),
    ("instructions-missing-output", "instructions", {"a.jsonl": b'{"instruction": "x"}\n'}, ["--data", "a.jsonl"],
     "a.jsonl: line 1: missing 'output' (records need instruction and output; input is optional)"),
    ("instructions-output-not-text", "instructions", {"a.json": b'[{"instruction": "x", "output": 3}]'},
     ["--data", "a.json"], "a.json: record 1: 'output' must be a string (got int)"),
    ("instructions-empty", "instructions", {"a.jsonl": b"\n"}, ["--data", "a.jsonl"], "a.jsonl: no records"),
    ("tokenizer-missing", "instructions", {"a.jsonl": GOOD_RECORD.encode()}, ["--data", "a.jsonl"],
     "data.tokenizer: ./tok: no such tokenizer folder"),
    ("tokenizer-folder-without-tokenizer", "instructions", {"a.jsonl": GOOD_RECORD.encode(), "tok": None},
     ["--data", "a.jsonl"], "data.tokenizer: ./tok: cannot load a tokenizer from this folder"),
    ("hf-datasets-no-such-column", "hf-text", {"rows.jsonl": b'{"text": "hello"}\n'}, ["--data", "rows.jsonl"],
     "data.columns: {tmp}/rows.jsonl: no column 'content' (columns: text)"),
    ("hf-datasets-not-a-dataset", "hf-text", {"rows.csv": b"a,b\n"}, ["--data", "rows.csv"],
     "rows.csv: expected a save_to_disk folder (dataset_dict.json or state.json), .parquet or .jsonl files"),
    ("data-for-builtin-data", "builtin", {}, ["--data", "somewhere"],
     "--data: recipe.yaml reads built-in data 'digits'; --data gives the path of data.format data"),
]


@pytest.mark.parametrize("case_id, kind, files, args, expected", DATA_CASES, ids=[c[0] for c in DATA_CASES])
def test_bad_data_input(case_id, kind, files, args, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, content in files.items():
        path = tmp_path / name
        if content is None:
            path.mkdir(parents=True, exist_ok=True)
        elif content == "png":
            _png(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RUNNABLE if kind == "builtin" else _recipe(kind)))
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("the user's own file, which must survive\n")
    before = snapshot(out)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "recipe.yaml", "--out", str(out), "--device", "cpu", "--micro-batch-max", "2", *args,
              "--force"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = err.strip().splitlines()
    wanted = expected.format(tmp=tmp_path)
    assert len(lines) == 1 and lines[0].startswith("error: ") and wanted in lines[0], err
    assert snapshot(out) == before


@pytest.mark.parametrize("workers", [0, 1])
def test_unreadable_image_mid_run_is_one_line_naming_the_file(workers, tmp_path, capsys, monkeypatch):
    """Found only when a worker reads it: still one line, exit 2, no traceback from the worker."""
    monkeypatch.chdir(tmp_path)
    for number in range(4):
        _png(tmp_path / "train" / "a" / f"{number}.png")
    (tmp_path / "train" / "a" / "4.png").write_text("not an image")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({**_recipe("images"), "batch": {"effective": 5},
                                                          "data": {**_recipe("images")["data"], "shuffle": False}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "recipe.yaml", "--out", "out", "--device", "cpu", "--micro-batch-max", "5", "--data", "train",
              "--workers", str(workers)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.strip().splitlines() if not line.startswith("note: ")]  # said before training
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: {tmp_path / 'train' / 'a' / '4.png'}: cannot read as an image"), err
