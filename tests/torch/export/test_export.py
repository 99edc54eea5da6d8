"""`reproduce.export`: the plan in HF, Lightning, DeepSpeed, Accelerate and torchrun terms.

The arithmetic and the schedule are checked here for shipped recipes; the real libraries validate the emitted
forms (`pip install -e .[exports]`, which `make setup` installs; DeepSpeed's extra is separate and may skip).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reproduce.errors import UserError
from reproduce.export import FORMATS, export
from reproduce.export.code import lr_factor_source
from reproduce.export.hf import hf_scheduler
from reproduce.plan.launch import torchrun_command
from reproduce.plan.planner import lr_at, make_plan
from reproduce.plan.recipe import load_recipe, parse_recipe

PAPERS = Path(__file__).resolve().parents[3] / "papers"
RECIPES = sorted(PAPERS.glob("*.yaml"))
NOT_IN_CI = "optional test extra: pip install -e .[exports] (make setup installs it)"
DEEPSPEED_SKIP = (
    "deepspeed not installed (optional extra: pip install -e .[exports-deepspeed], which may not build on every "
    "machine; CI does not install it)"
)


def planned(name: str, micro_batch_max: int, world_size: int, **kwargs):
    path = PAPERS / name
    return make_plan(load_recipe(path), micro_batch_max, world_size, recipe_path=f"papers/{name}", **kwargs)


@pytest.fixture(scope="module")
def goyal():
    return planned("goyal2017-resnet50.yaml", 32, 8)


@pytest.fixture(scope="module")
def nanogpt():
    return planned("nanogpt-gpt2-124m.yaml", 12, 8)


def emit(plan, fmt: str) -> str:
    """The text of the plan as `fmt`, as `reproduce plan --emit` prints it."""
    return export(plan, fmt).text


def run_source(text: str) -> dict:
    namespace: dict = {}
    exec(compile(text, "<emitted>", "exec"), namespace)  # noqa: S102 (our own generated code)
    return namespace


def strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("#"))


@pytest.mark.subprocess
def test_export_imports_no_torch():
    code = "import sys, reproduce.export, reproduce.plan.builtin_names; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_every_shipped_recipe_emits_with_the_arithmetic_first(path, fmt):
    plan = make_plan(load_recipe(path), 16, 2 if load_recipe(path).batch.sequences % 2 == 0 else 1,
                    recipe_path=f"papers/{path.name}")
    if fmt == "slurm" and plan.world_size == 1:  # a launcher for several processes (tests/e2e/test_nodes.py)
        with pytest.raises(UserError, match="`emit_format` slurm: the plan runs on 1 process, which needs no launcher"):
            emit(plan, fmt)
        return
    lines = emit(plan, fmt).splitlines()
    first = lines[1] if fmt == "slurm" else lines[0]  # (a shell script opens with its #!/bin/bash)
    p = plan
    assert first.startswith(f"# reproduce plan: micro-batch {p.micro_batch} x accumulation {p.accumulation_steps} "
                            f"x world {p.world_size} = {p.effective_batch} ")
    assert ("as published (no LR rule)" in first) == plan.exact


def test_hf_arithmetic_goyal(goyal):
    out = export(goyal, "hf")
    v = out.values
    assert (v["per_device_train_batch_size"], v["gradient_accumulation_steps"]) == (32, 32)
    assert v["per_device_train_batch_size"] * v["gradient_accumulation_steps"] * goyal.world_size == 8192
    assert v["learning_rate"] == 3.2 and v["warmup_steps"] == 780 and v["max_steps"] == 14040
    assert v["optim"] == "sgd" and v["optim_args"] == "momentum=0.9,nesterov=True"
    assert v["max_grad_norm"] == 0.0  # no clipping; HF's default of 1.0 would clip
    assert "average_tokens_across_devices" not in v
    # what HF cannot express is said, not hidden
    assert any("warms up linearly from lr 0" in n for n in out.notes)
    assert any("no step (multi-step) decay" in n for n in out.notes)
    assert "class PlanTrainer(Trainer)" in out.text and "def lr_factor(step):" in out.text


def test_hf_arithmetic_nanogpt_tokens(nanogpt):
    out = export(nanogpt, "hf")
    v = out.values
    assert (v["per_device_train_batch_size"], v["gradient_accumulation_steps"]) == (12, 5)
    assert 12 * 5 * 8 * 1024 == 491520
    assert v["lr_scheduler_type"] == "cosine_with_min_lr" and v["lr_scheduler_kwargs"] == {"min_lr": 6e-5}
    assert (v["adam_beta1"], v["adam_beta2"], v["bf16"], v["fp16"]) == (0.9, 0.95, True, False)
    assert v["average_tokens_across_devices"] is True and v["max_grad_norm"] == 1.0
    assert "PlanTrainer" not in out.text  # the cosine schedule is HF's own: nothing to replace
    assert "(491520 tokens)" in out.text.splitlines()[0]


@pytest.mark.parametrize(
    "decay, expected",
    [
        ({"kind": "linear"}, ("linear", {})),
        ({"kind": "linear", "min_lr": 0.01}, ("polynomial", {"lr_end": 0.01, "power": 1.0})),
        ({"kind": "polynomial", "power": 2.0, "min_ratio": 0.5}, ("polynomial", {"lr_end": 0.05, "power": 2.0})),
        ({"kind": "cosine"}, ("cosine", {})),
        ({"kind": "constant"}, ("constant", {})),
    ],
)
def test_hf_scheduler_mapping(decay, expected):
    recipe = parse_recipe({
        "batch": {"effective": 64}, "task": "classification", "model": {"builtin": "mlp"},
        "data": {"builtin": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1},
        "schedule": {"decay": decay, "total": {"steps": 100}},
    })
    kind, kwargs, problems = hf_scheduler(make_plan(recipe, 16))
    assert (kind, kwargs) == expected and problems == []


def test_lightning_arithmetic(goyal, nanogpt):
    out = export(goyal, "lightning")
    t = out.values["trainer"]
    assert out.values["batch_size"] * t["accumulate_grad_batches"] * t["devices"] * t["num_nodes"] == 8192
    assert (t["precision"], t["max_steps"], t["gradient_clip_val"], t["strategy"]) == ("32-true", 14040, None, "ddp")
    ns = run_source(out.text)
    assert ns["trainer_kwargs"] == t and ns["batch_size"] == 32
    t = export(nanogpt, "lightning").values["trainer"]
    assert (t["accumulate_grad_batches"], t["precision"], t["gradient_clip_val"]) == (5, "bf16-mixed", 1.0)
    assert any("loss_sum * N * W / window_items" in n for n in export(nanogpt, "lightning").notes)


def test_deepspeed_arithmetic(goyal, nanogpt):
    for plan in (goyal, nanogpt):
        text = emit(plan, "deepspeed")
        config = json.loads(strip_comments(text))
        assert config == export(plan, "deepspeed").values
        assert config["train_batch_size"] == (
            config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * plan.world_size
        ) == plan.effective_batch
    config = export(goyal, "deepspeed").values
    assert config["optimizer"] == {"type": "SGD", "params": {"lr": 3.2, "weight_decay": 1e-4, "momentum": 0.9,
                                                             "nesterov": True}}
    assert config["scheduler"]["type"] == "WarmupLR" and config["scheduler"]["params"]["warmup_type"] == "linear"
    assert "gradient_clipping" not in config
    config = export(nanogpt, "deepspeed").values
    assert config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 1.0
    assert config["scheduler"]["params"]["cos_min_ratio"] == pytest.approx(0.1)


def test_accelerate_arithmetic(goyal, nanogpt):
    out = export(goyal, "accelerate")
    assert yaml.safe_load(out.text) == out.values["config"]  # the comments are YAML comments
    assert out.values["config"]["num_processes"] * out.values["accelerator"]["gradient_accumulation_steps"] * \
        out.values["batch_size"] == 8192
    assert out.values["config"]["distributed_type"] == "MULTI_GPU"
    out = export(nanogpt, "accelerate")
    assert out.values["config"]["mixed_precision"] == "bf16"
    assert out.values["accelerator"]["gradient_accumulation_steps"] == 5
    assert "clip_grad_norm_(model.parameters(), 1.0)" in out.text
    assert any("num_processes times per" in n for n in out.notes)


def test_torchrun_matches_the_launcher_reproduce_uses(goyal):
    from reproduce.train.distributed.processes import torchrun_command as launcher

    args = ["plan.yaml", "--out", "runs/x"]
    # what `reproduce run --nproc-per-node` really launches (the launcher uses export's builder)
    assert launcher(args, 8) == [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=8", "--standalone",
                                 "-m", "reproduce", "run", *args]
    assert launcher(args, 4, 2, 1, "h:1") == [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--nnodes=2", "--node-rank=1",
        "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "-m", "reproduce", "run", *args]
    assert torchrun_command(args, 8, python="python")[0] == "python"
    out = export(goyal, "torchrun")
    assert out.values["command"] == ["python", "-m", "torch.distributed.run", "--nproc-per-node=8", "--standalone",
                                     "-m", "reproduce", "run", "plan.yaml", "--out", "runs/goyal2017-resnet50"]
    assert "--micro-batch-max 32 --world-size 8 --out plan.yaml" in out.values["plan_command"]
    assert any("plan-only here" in n for n in out.notes)  # no resnet50 or ImageNet here
    runnable = export(planned("digits-mlp.yaml", 32, 2), "torchrun")
    assert runnable.notes == [] and "--nproc-per-node=2" in runnable.text


def test_inexact_plan_states_the_rule():
    plan = planned("goyal2017-resnet50.yaml", 30, 3)  # 8192 is not divisible by 3
    first = emit(plan, "hf").splitlines()[0]
    assert not plan.exact and "not the paper's 8192" in first and "by the linear rule" in first


@pytest.mark.parametrize("name", ["goyal2017-resnet50.yaml", "nanogpt-gpt2-124m.yaml", "pysource-gpt.yaml",
                                  "hu2021-lora-gpt2m-e2e.yaml", "digits-mlp.yaml"])
def test_lr_factor_is_the_plans_schedule(name):
    plan = planned(name, 16, 1, dataset_size=5000)
    lr_factor = run_source("\n".join(lr_factor_source(plan)))["lr_factor"]
    total = plan.optimizer_steps or 1000
    steps = sorted({0, 1, 2, plan.warmup_steps - 1, plan.warmup_steps, plan.warmup_steps + 1,
                    *plan.schedule.decay_milestones, total // 2, total - 1, total} - {-1})
    for step in steps:
        assert plan.lr * lr_factor(step) == pytest.approx(lr_at(plan, step), rel=1e-12, abs=1e-15), step


@pytest.mark.parametrize("no_decay", [[], ["bias"], ["norm", "bias"], ["1d"], ["embedding", "norm"]])
def test_emitted_param_groups_equal_the_trainers(no_decay):
    import torch

    from reproduce.export.code import param_groups_source
    from reproduce.models.small import GPT
    from reproduce.train.optim.optimizers import param_groups

    recipe = parse_recipe({
        "batch": {"effective": 8}, "task": "language-modeling", "model": {"builtin": "gpt"},
        "data": {"builtin": "pysource"}, "optimizer": {"name": "adamw", "lr": 1e-3, "weight_decay": 0.1,
                                                        "no_decay": no_decay},
        "schedule": {"total": {"steps": 10}},
    })
    model = GPT(vocab_size=32, block_size=8, layers=1, heads=2, dim=16)
    groups = run_source("\n".join(param_groups_source(make_plan(recipe, 4))))["param_groups"](model)
    reference = param_groups(model, 0.1, no_decay)
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in reference]
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in reference]
    assert isinstance(model, torch.nn.Module)


def test_unknown_format_is_a_user_error(goyal):
    with pytest.raises(UserError, match="`emit_format`: expected one of hf, lightning, deepspeed, accelerate, "
                                        "torchrun"):
        emit(goyal, "keras")


# ---- validation by the real libraries (optional extra) ------------------------------------------------------


def test_transformers_accepts_the_training_arguments(goyal, nanogpt, tmp_path):
    transformers = pytest.importorskip("transformers", reason=f"transformers not installed; {NOT_IN_CI}")
    import torch

    for plan in (goyal, nanogpt):
        ns = run_source(emit(plan, "hf"))
        args = transformers.TrainingArguments(**{**ns["training_args"], "output_dir": str(tmp_path), "use_cpu": True})
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps * plan.world_size == \
            plan.effective_batch
        assert args.max_steps == plan.optimizer_steps and args.warmup_steps == plan.warmup_steps
    # nanoGPT's schedule is HF's own cosine_with_min_lr: the LR of every step is the plan's
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = transformers.get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                                           num_training_steps=args.max_steps,
                                           scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    lambdas = scheduler.lr_lambdas[0]
    for step in (0, 1, 1999, 2000, 2001, 300000, 599999, 600000):
        assert nanogpt.lr * lambdas(step) == pytest.approx(lr_at(nanogpt, step), rel=1e-9, abs=1e-15), step
    # goyal's step decay is not: PlanTrainer is a real Trainer whose scheduler is lr_factor
    ns = run_source(emit(goyal, "hf"))
    assert issubclass(ns["plan_trainer"](), transformers.Trainer)


def test_lightning_accepts_the_trainer_arguments(goyal, nanogpt):
    lightning = pytest.importorskip("lightning", reason=f"lightning not installed; {NOT_IN_CI}")
    import torch

    for plan in (goyal, nanogpt):
        ns = run_source(emit(plan, "lightning"))
        kwargs = {**ns["trainer_kwargs"], "accelerator": "cpu"}  # the emitted "auto", pinned to this CPU
        trainer = lightning.Trainer(**kwargs, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.accumulate_grad_batches == plan.accumulation_steps
        assert trainer.max_steps == plan.optimizer_steps and trainer.num_devices == plan.world_size
        assert ns["batch_size"] * trainer.accumulate_grad_batches * trainer.num_devices == plan.effective_batch
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        configured = ns["configure_optimizers"](model)
        scheduler = configured["lr_scheduler"]["scheduler"]
        assert configured["lr_scheduler"]["interval"] == "step"
        for step in range(3):
            assert configured["optimizer"].param_groups[0]["lr"] == pytest.approx(lr_at(plan, step), rel=1e-12)
            configured["optimizer"].step()
            scheduler.step()


def test_deepspeed_config_checker_accepts_it(goyal, nanogpt, tmp_path, monkeypatch):
    pytest.importorskip("deepspeed", reason=DEEPSPEED_SKIP)
    import deepspeed.runtime.config as ds_config

    world = {"size": 1}
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world["size"])
    for plan in (goyal, nanogpt):
        path = tmp_path / "ds_config.json"
        path.write_text(emit(plan, "deepspeed"))  # with its # comments: DeepSpeed reads hjson
        world["size"] = plan.world_size
        config = ds_config.DeepSpeedConfig(str(path))
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
            == (plan.effective_batch, plan.micro_batch, plan.accumulation_steps)
        # the checker is real: a world size that breaks the product is refused
        world["size"] = plan.world_size + 1
        with pytest.raises(AssertionError, match="Check batch related parameters"):
            ds_config.DeepSpeedConfig(str(path))


def test_deepspeed_schedule_lags_one_step_in_warmup_as_noted(nanogpt):
    pytest.importorskip("deepspeed", reason=DEEPSPEED_SKIP)
    import torch
    from deepspeed.runtime import lr_schedules

    plan = planned("pysource-gpt.yaml", 16, 1, dataset_size=20000)  # warm-up 20, cosine to step 300
    block = export(plan, "deepspeed").values["scheduler"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=plan.lr)
    scheduler = getattr(lr_schedules, block["type"])(optimizer, **block["params"])
    warmup = plan.warmup_steps
    for step in range(plan.optimizer_steps):  # as DeepSpeed's engine: optimizer step, then scheduler.step()
        lr = optimizer.param_groups[0]["lr"]
        if 1 <= step <= warmup:
            assert lr == pytest.approx(lr_at(plan, step - 1), rel=1e-9, abs=1e-15), step
        elif step > warmup:
            assert lr == pytest.approx(lr_at(plan, step), rel=1e-9, abs=1e-15), step
        optimizer.step()
        scheduler.step()
    assert any("one optimizer step later" in n for n in export(plan, "deepspeed").notes)
    assert math.isfinite(lr)


def test_accelerate_reads_the_config(goyal, nanogpt, tmp_path):
    pytest.importorskip("accelerate", reason=f"accelerate not installed; {NOT_IN_CI}")
    from accelerate import Accelerator
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.state import AcceleratorState, GradientState

    for plan in (goyal, nanogpt):
        out = export(plan, "accelerate")
        path = tmp_path / "accelerate.yaml"
        path.write_text(out.text)
        config = ClusterConfig.from_yaml_file(str(path))
        assert config.num_processes == plan.world_size
        assert config.mixed_precision == out.values["accelerator"]["mixed_precision"]
        try:
            accelerator = Accelerator(**{**out.values["accelerator"], "mixed_precision": "no"}, cpu=True)
            assert accelerator.gradient_accumulation_steps == plan.accumulation_steps
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()


# ---- batch.sharding: fsdp --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded_gpt():
    """The pysource GPT sharded over 4 processes in bf16 (its blocks are the built-in GPT's `Block`)."""
    from reproduce.plan.overlay import Change, overlay

    recipe = overlay(load_recipe(PAPERS / "pysource-gpt.yaml"), [Change("batch.sharding", "fsdp")], "pysource-gpt.yaml")
    recipe = recipe.model_copy(update={"precision": "bf16"})
    return make_plan(recipe, 16, 4, recipe_path="papers/pysource-gpt.yaml", dataset_size=20000)


def test_sharded_plan_emits_the_fsdp_forms_and_says_what_differs(sharded_gpt, goyal):
    accelerate = export(sharded_gpt, "accelerate")
    assert accelerate.values["config"]["distributed_type"] == "FSDP"
    assert accelerate.values["config"]["fsdp_config"] == {
        "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_reshard_after_forward": True,
        "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_offload_params": False,
        "fsdp_transformer_layer_cls_to_wrap": "Block"}
    assert "reduce_dtype=torch.float32" in accelerate.text  # Accelerate's bf16 alone would reduce in bf16
    lightning = export(sharded_gpt, "lightning")
    assert lightning.values["trainer"]["strategy"] == "fsdp" and lightning.values["fsdp_blocks"] == ["Block"]
    deepspeed = export(sharded_gpt, "deepspeed")
    assert deepspeed.values["zero_optimization"]["stage"] == 3
    for form in (accelerate, lightning, deepspeed):
        assert any("reduce-scatters the gradients once per optimizer step" in note for note in form.notes), form.fmt
    assert any("--emit accelerate" in note for note in export(sharded_gpt, "hf").notes)
    # an unsharded plan keeps its DDP forms
    assert export(goyal, "accelerate").values["config"]["distributed_type"] == "MULTI_GPU"
    assert export(goyal, "lightning").values["trainer"]["strategy"] == "ddp"
    assert "zero_optimization" not in export(goyal, "deepspeed").values


def test_accelerate_and_lightning_accept_the_fsdp_forms(sharded_gpt, tmp_path):
    pytest.importorskip("accelerate", reason=f"accelerate not installed; {NOT_IN_CI}")
    lightning = pytest.importorskip("lightning", reason=f"lightning not installed; {NOT_IN_CI}")
    import torch
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.commands.config.config_args import ClusterConfig

    from reproduce.models.small import GPT

    out = export(sharded_gpt, "accelerate")
    path = tmp_path / "accelerate.yaml"
    path.write_text(out.text)
    config = ClusterConfig.from_yaml_file(str(path))
    assert config.distributed_type == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    plugin = FullyShardedDataParallelPlugin(**out.values["fsdp_plugin"])
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["Block"]

    ns = run_source(emit(sharded_gpt, "lightning"))
    model = GPT(layers=2, dim=16, heads=2)
    strategy = ns["fsdp_strategy"](model)
    assert isinstance(strategy, lightning.pytorch.strategies.FSDPStrategy)
    policy = strategy.kwargs["auto_wrap_policy"]
    assert policy(model.blocks[0], False, 0) and not policy(model, False, 0)  # one unit per block
    assert strategy.mixed_precision.param_dtype == torch.bfloat16
    assert strategy.mixed_precision.reduce_dtype == torch.float32


@pytest.mark.parametrize("way", ["sorted", "packed", "none"])
def test_the_exports_carry_data_packing(way, tmp_path):
    """The instruction recipe's grouping: the Trainer's batch_rebalance for sorted (TrainingArguments takes it),
    flattening with a varlen kernel for packed, and a note in the frameworks that have no setting for it."""
    transformers = pytest.importorskip("transformers", reason=f"transformers not installed; {NOT_IN_CI}")
    recipe = load_recipe(PAPERS / "hu2021-lora-gpt2m-e2e.yaml")
    plan = make_plan(parse_recipe({**recipe.model_dump(exclude_unset=True),
                                   "data": {**recipe.data.model_dump(exclude_unset=True), "packing": way}}), 4)
    assert plan.recipe.data.packing == way
    hf = export(plan, "hf")
    args = transformers.TrainingArguments(**{**run_source(hf.text)["training_args"], "output_dir": str(tmp_path),
                                             "use_cpu": True})
    assert args.train_sampling_strategy == ("batch_rebalance" if way == "sorted" else "random")
    assert any("DataCollatorWithFlattening" in n for n in hf.notes) is (way == "packed")
    for framework in ("lightning", "accelerate", "deepspeed"):
        said = [n for n in export(plan, framework).notes if n.startswith(f"data.packing {way}:")]
        assert len(said) == (0 if way == "none" else 1), framework
