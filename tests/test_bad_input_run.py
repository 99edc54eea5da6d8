"""Bad input to `reproduce run`: exit 2, one clear line naming the file or option and the field, no traceback,
and the output folder left exactly as it was."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml

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


def snapshot(folder: Path) -> dict:
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


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
    ("data-factory-wrong-kind", changed(data={"factory": "json:dumps", "kwargs": {"obj": 1}}), [],
     "data: the factory must return a dict with a 'train' dataset"),
    ("optimizer-without-implementation", changed(optimizer={"name": "lamb", "lr": 0.1}), [],
     "optimizer.name: lamb has no PyTorch implementation to run here"),
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
     "--micro-batch-max: with batch.sharding fsdp give it (or --meter estimate)"),
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
    data["accumulation_steps"] = 3  # 16 x 3 x 1 != 64
    plan_path.write_text(yaml.safe_dump(data))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(plan_path), "--out", str(tmp_path / "out"), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"error: {plan_path}: effective_batch: micro_batch x accumulation_steps x world_size = 16 x 3 x 1" in err
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
    assert err.strip() == (f"error: --sharding: the run in {out} was started with sharding none; resume it with the "
                           "same (got fsdp)")
    assert snapshot(out) == before
