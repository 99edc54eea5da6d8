"""Bad input: exit code 2, one `error: FILE: field: message` line per problem, no traceback, nothing lost.

A table of bad recipes and bad options, each run through the real CLI (`reproduce.cli.main`) in this
process, a few through the installed `reproduce` script in a subprocess, and hand-edited plan files
loaded with `reproduce.plan.planfile.load_plan`.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from reproduce.cli import main
from reproduce.errors import UserError
from reproduce.plan.planfile import load_plan

# Goyal et al. 2017 (ResNet-50 in one hour): a valid recipe every bad case starts from.
GOYAL = """\
paper: {title: "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", year: 2017, arxiv: "1706.02677"}
batch:
  effective: 8192          # 256 workers x 32
  unit: samples
  devices: 256
  per_device: 32           # also the BatchNorm batch
task: classification
model: {builtin: resnet50, norm_layers: [batchnorm]}
data: {name: imagenet-1k, available: false, train_size: 1281167, shuffle: true, drop_last: true}
optimizer: {name: nesterov, lr: 3.2, momentum: 0.9, weight_decay: 1.0e-4, no_decay: [norm, bias]}
schedule:
  warmup: {epochs: 5, start_lr: 0.1}
  decay: {kind: step, milestones: {epochs: [30, 60, 80]}, factor: 0.1}
  total: {epochs: 90}
precision: fp32
scaling_rule: linear
reported: [{metric: top1_error, value: 23.74, split: val, tolerance: 0.09}]
"""

RECIPE = "papers/recipe.yaml"  # where each case's recipe is written, relative to the test's directory
OK_ARGS = ("--micro-batch-max", "8")
DELETE = object()


def mutate(changes: dict | None = None, **kwargs) -> str:
    """GOYAL as YAML with dotted-path changes: {"optimizer.lr": "fast"}; DELETE removes a key."""
    data = yaml.safe_load(GOYAL)
    for dotted, value in {**(changes or {}), **kwargs}.items():
        *parents, last = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = copy.deepcopy(value)
    return yaml.safe_dump(data, sort_keys=False)


@dataclass
class Case:
    id: str
    text: str | None  # the recipe file's content; None: no file is written
    expect: list[str]  # substrings one error line must all contain; {path} is the recipe path
    args: tuple[str, ...] = OK_ARGS  # options after RECIPE
    recipe_arg: str | None = RECIPE  # the RECIPE argument; None: left out
    lines: int | None = 1  # how many error lines; None: at least one
    marks: list = field(default_factory=list)

    def param(self):
        return pytest.param(self, id=self.id, marks=self.marks)


def bug(reason: str):
    return [pytest.mark.xfail(strict=True, reason=reason)]


CASES = [
    # ---- the file itself ---------------------------------------------------------------------------
    Case(
        "malformed-yaml",
        "batch: [1, 2\ntask: classification\n",
        ["error: {path}: YAML syntax error at line 2, column 5:"],
    ),
    Case(
        "tab-indentation",
        "batch:\n\teffective: 3\n",
        ["error: {path}: YAML syntax error at line 2, column 1:"],
    ),
    Case(
        "python-tag",
        "batch: !!python/object:os.system {}\n",
        ["error: {path}: YAML syntax error at line 1, column 8:", "constructor"],
    ),
    Case(
        "two-documents",
        GOYAL + "---\nbatch: {effective: 1}\n",
        ["error: {path}: YAML syntax error at line", "another document"],
    ),
    Case("top-level-list", "- batch\n- task\n", ["error: {path}: expected a mapping", "(got list)"]),
    # ---- hostile or absurd recipes: refused in bounded time and memory, values echoed short -----------------------
    Case(
        "alias-bomb",
        "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
        + "batch: {effective: *i}\n",
        ["error: {path}: its aliases (*name) expand to 9.26e+08 values, more than 100,000"],
    ),
    Case("nested-brackets", "batch: " + "[" * 5000 + "]" * 5000 + "\n",
         ["error: {path}: line 1: nested more than 64 levels deep"]),
    Case("long-value-echoed-short", mutate({"batch.effective": "x" * 5000}),
         ["error: {path}: batch.effective: expected an integer (got 'xxxxxxxx", "...x')"]),
    Case("lr-infinite", mutate({"optimizer.lr": float("inf")}),
         ["error: {path}: optimizer.lr: Input should be a finite number (got inf)"]),
    Case("effective-true", mutate({"batch.effective": True}),
         ["error: {path}: batch.effective: expected a number (got True)"]),
    Case("seed-past-64-bits", mutate({"seed": 2**64}), ["error: {path}: seed: must be <= 18446744073709551615"]),
    Case("epochs-1e18", mutate({"schedule.total": {"epochs": 1e18}}),
         ["error: {path}: schedule.total:", "optimizer steps; no run takes more than 1e+09"]),
    Case("top-level-string", '"a recipe"\n', ["error: {path}: expected a mapping", "(got str)"]),
    Case("unhashable-key", GOYAL + "? [a, b]\n: 1\n",
         ["error: {path}: YAML syntax error at line 18, column 3: a list as a key; keys are names"]),
    Case("unknown-key-with-brackets", GOYAL + "foo[0]: 1\n", ["error: {path}: foo[0]: unknown key (known: paper,"]),
    Case("unknown-key-named-like-a-type", GOYAL + "list: 1\n", ["error: {path}: list: unknown key (known: paper,"]),
    Case("nul-byte", GOYAL + 'notes: "a\0b"\n',
         ["error: {path}: YAML syntax error at line 18, column 10: the character U+0000 is not allowed here"]),
    Case("three-thousand-unknown-keys", GOYAL + "".join(f"k{i}: 1\n" for i in range(3000)),
         ["error: {path}: (top level): 3,000 unknown keys ('k0', 'k1', 'k2', ...); known: paper, batch"]),
    Case("twenty-megabyte-title", mutate({"paper.title": "x" * 20_000_000}),
         ["error: {path}: 20,000,", "bytes, more than 1,048,576; a recipe is a few kilobytes"]),
    Case("empty-file", "", ["error: {path}: the file is empty; expected a recipe"]),
    Case("comments-only", "# nothing yet\n", ["error: {path}: the file is empty; expected a recipe"]),
    Case("not-utf8", "\udcff\udcfe", ["error: {path}: cannot read:", "utf-8"]),
    Case("missing-file", None, ["error: {path}: no such recipe file"]),
    Case("directory", "<dir>", ["error: {path}: is not a file"]),
    # ---- unknown keys, at several depths ---------------------------------------------------------------
    Case(
        "unknown-top",
        mutate({"optimiser": {"name": "sgd"}}),
        ["error: {path}: optimiser: unknown key (did you mean 'optimizer'?)"],
    ),
    Case(
        "unknown-batch",
        mutate({"batch.efective": 3}),
        ["error: {path}: batch.efective: unknown key (did you mean 'effective'?)"],
    ),
    Case(
        "unknown-warmup",
        mutate({"schedule.warmup.epoch": 3}),
        ["error: {path}: schedule.warmup.epoch: unknown key (did you mean 'epochs'?)"],
    ),
    Case(
        "unknown-milestones",
        mutate({"schedule.decay.milestones.epoch": [1]}),
        ["error: {path}: schedule.decay.milestones.epoch: unknown key (did you mean 'epochs'?)"],
    ),
    Case(
        "unknown-no-close-match",
        mutate({"batch.zzzz": 3}),
        ["error: {path}: batch.zzzz: unknown key (known: effective, unit, sequence_length"],
    ),
    # ---- wrong types -----------------------------------------------------------------------------------
    Case(
        "string-lr",
        mutate({"optimizer.lr": "fast"}),
        ["error: {path}: optimizer.lr: expected a number (got 'fast')"],
    ),
    Case(
        "float-effective",
        mutate({"batch.effective": 8192.5}),
        ["error: {path}: batch.effective: expected an integer (got 8192.5)"],
    ),
    Case(
        "list-instead-of-mapping",
        mutate({"model": ["resnet50"]}),
        ["error: {path}: model: expected a mapping (got ['resnet50'])"],
    ),
    Case(
        "scalar-instead-of-mapping",
        mutate({"batch": 5}),
        ["error: {path}: batch: expected a mapping (got 5)"],
    ),
    Case(
        "mapping-instead-of-list",
        mutate({"reported": {"metric": "x"}}),
        ["error: {path}: reported: expected a list"],
    ),
    Case(
        "bool-not-bool",
        mutate({"data.shuffle": "maybe"}),
        ["error: {path}: data.shuffle: expected true or false (got 'maybe')"],
    ),
    Case(
        "milestones-not-list",
        mutate({"schedule.decay.milestones": {"epochs": "30"}}),
        ["error: {path}: schedule.decay.milestones.epochs: expected a list (got '30')"],
    ),
    Case(
        "betas-three",
        mutate({"optimizer.name": "adam", "optimizer.momentum": DELETE, "optimizer.betas": [0.9] * 3}),
        ["error: {path}: optimizer.betas:", "2 items"],
    ),
    # ---- values out of range -----------------------------------------------------------------------------
    Case(
        "negative-effective",
        mutate({"batch.effective": -3}),
        ["error: {path}: batch.effective: must be > 0 (got -3)"],
    ),
    Case(
        "zero-per-device",
        mutate({"batch.per_device": 0}),
        ["error: {path}: batch.per_device: must be > 0 (got 0)"],
    ),
    Case("zero-lr", mutate({"optimizer.lr": 0}), ["error: {path}: optimizer.lr: must be > 0", "(got 0)"]),
    Case(
        "momentum-one",
        mutate({"optimizer.momentum": 1.0}),
        ["error: {path}: optimizer.momentum: must be < 1"],
    ),
    Case(
        "year-out-of-range",
        mutate({"paper.year": 3000}),
        ["error: {path}: paper.year: must be <= 2100 (got 3000)"],
    ),
    # ---- batch arithmetic --------------------------------------------------------------------------------
    Case(
        "tokens-without-sequence-length",
        mutate({"batch.unit": "tokens"}),
        ["error: {path}: batch.sequence_length: required when unit is tokens"],
    ),
    Case(
        "tokens-not-whole-sequences",
        mutate({"batch.unit": "tokens", "batch.sequence_length": 1000}),
        [
            "error: {path}: batch.effective: 8192 tokens is not a whole number of sequences",
            "sequence_length 1000",
        ],
    ),
    Case(
        "devices-times-per-device-mismatch",
        mutate({"batch.devices": 128}),
        [
            "error: {path}: batch: devices x per_device = 128 x 32 = 4096, but effective is 8192 samples",
            "accumulation",
        ],
    ),
    # ---- optimizer ---------------------------------------------------------------------------------------
    Case(
        "unknown-optimizer",
        mutate({"optimizer.name": "adamax"}),
        ["error: {path}: optimizer.name: expected one of 'sgd', 'nesterov'", "(got 'adamax')"],
    ),
    Case(
        "beta-out-of-range",
        mutate({"optimizer.name": "adam", "optimizer.momentum": DELETE, "optimizer.betas": [0.9, 1.5]}),
        ["error: {path}: optimizer.betas: each must be in [0, 1) (got [0.9, 1.5])"],
    ),
    Case(
        "nesterov-without-momentum",
        mutate({"optimizer.momentum": DELETE}),
        ["error: {path}: optimizer.momentum: nesterov needs momentum > 0"],
    ),
    # ---- schedule ----------------------------------------------------------------------------------------
    Case(
        "warmup-two-units",
        mutate({"schedule.warmup.steps": 100}),
        [
            "error: {path}: schedule.warmup: give exactly one of steps, epochs, samples, tokens",
            "(got steps, epochs)",
        ],
    ),
    Case(
        "warmup-ratio-and-epochs",
        mutate({"schedule.warmup.ratio": 0.1}),
        ["error: {path}: schedule.warmup: give ratio or one of", "not both"],
    ),
    Case(
        "total-missing",
        mutate({"schedule.total": DELETE}),
        ["error: {path}: schedule.total: required field is missing"],
    ),
    Case(
        "total-empty",
        mutate({"schedule.total": {}}),
        ["error: {path}: schedule.total: give exactly one of steps, epochs, samples, tokens (got none)"],
    ),
    Case(
        "step-decay-without-milestones",
        mutate({"schedule.decay.milestones": DELETE}),
        ["error: {path}: schedule.decay.milestones: required for kind step"],
    ),
    Case(
        "milestones-not-increasing",
        mutate({"schedule.decay.milestones": {"epochs": [30, 20, 80]}}),
        ["error: {path}: schedule.decay.milestones.epochs: milestones must be increasing"],
    ),
    Case(
        "total-in-tokens-without-sequence-length",
        mutate({"schedule.total": {"tokens": 10**9}}),
        ["error: {path}: schedule.total: counted in tokens, which needs batch.sequence_length"],
    ),
    # ---- model, data, loss, task, precision ------------------------------------------------------------
    Case(
        "bad-factory-string",
        mutate({"model": {"factory": "not a factory"}}),
        ["error: {path}: model.factory: expected 'package.module:function' (got 'not a factory')"],
    ),
    Case(
        "model-builtin-and-factory",
        mutate({"model.factory": "pkg.mod:fn"}),
        ["error: {path}: model: give either builtin or factory, not both"],
    ),
    Case(
        "data-available-without-source",
        mutate({"data.available": True}),
        ["error: {path}: data.available: data 'imagenet-1k' has no builtin or factory; set available: false"],
    ),
    # ---- data formats on disk (data.format) ------------------------------------------------------------
    Case(
        "data-format-unknown",
        mutate({"data.format": "webdataset"}),
        ["error: {path}: data.format: expected one of 'imagefolder', 'tokens', 'instructions', 'chat', 'hf-datasets' "
         "or 'segmentation'", "(got 'webdataset')"],
    ),
    Case(
        "data-format-without-path",
        mutate({"data.format": "imagefolder", "data.available": True, "data.image_size": 224}),
        ["error: {path}: data.path: required for imagefolder data", "reproduce run --data PATH"],
    ),
    Case(
        "data-path-without-format",
        mutate({"data.path": "/data/imagenet/train"}),
        ["error: {path}: data.path: only used with format: imagefolder | tokens | instructions | chat | hf-datasets | "
         "segmentation"],
    ),
    Case(
        "data-format-and-builtin",
        mutate({"data.format": "imagefolder", "data.builtin": "digits"}),
        ["error: {path}: data.format: give format (with path) or builtin/factory, not both"],
    ),
    Case(
        "data-format-wrong-task",
        mutate({"data.format": "tokens"}),
        ["error: {path}: data.format: tokens data is for task language-modeling (task is classification)"],
    ),
    Case(
        "data-augment-for-tokens",
        mutate({"task": "language-modeling", "batch.unit": "tokens", "batch.effective": 8192 * 4,
                "batch.sequence_length": 4, "data.format": "tokens", "data.augment": "imagenet"}),
        ["error: {path}: data.augment: only used with format imagefolder or hf-datasets (format is tokens)"],
    ),
    Case(
        "data-augment-unknown",
        mutate({"data.format": "imagefolder", "data.augment": "autoaugment"}),
        ["error: {path}: data.augment: expected one of 'imagenet' or 'none' (got 'autoaugment')"],
    ),
    Case(
        "data-dtype-float",
        mutate({"task": "language-modeling", "batch.unit": "tokens", "batch.effective": 8192 * 4,
                "batch.sequence_length": 4, "data.format": "tokens", "data.dtype": "float16"}),
        ["error: {path}: data.dtype: expected one of 'uint8', 'uint16', 'int32', 'uint32' or 'int64'",
         "(got 'float16')"],
    ),
    Case(
        "data-tokens-without-sequence-length",
        mutate({"task": "language-modeling", "data.format": "tokens"}),
        ["error: {path}: batch.sequence_length: required with data.format tokens"],
    ),
    Case(
        "data-imagefolder-without-image-size",
        mutate({"data.format": "imagefolder", "data.available": True, "data.path": "/data/train"}),
        ["error: {path}: data.image_size: required for image data"],
    ),
    Case(
        "data-instructions-without-tokenizer",
        mutate({"task": "language-modeling", "data.format": "instructions", "data.available": True,
                "data.path": "alpaca_data.json", "data.max_length": 512}),
        ["error: {path}: data.tokenizer: required for text data"],
    ),
    Case(
        "data-instructions-without-max-length",
        mutate({"task": "language-modeling", "data.format": "instructions", "data.available": True,
                "data.path": "alpaca_data.json", "data.tokenizer": "llama"}),
        ["error: {path}: data.max_length: required for text data"],
    ),
    Case(
        "data-template-unknown",
        mutate({"task": "language-modeling", "data.format": "instructions", "data.template": "vicuna"}),
        ["error: {path}: data.template: expected one of 'alpaca', 'alpaca-lora' or 'e2e' (got 'vicuna')"],
    ),
    Case(
        "data-hf-datasets-without-columns",
        mutate({"data.format": "hf-datasets"}),
        ["error: {path}: data.columns: required for format hf-datasets"],
    ),
    Case(
        "data-hf-datasets-unknown-columns",
        mutate({"data.format": "hf-datasets", "data.columns": {"pixels": "img", "label": "label"}}),
        ["error: {path}: data.columns: expected the keys of one of", "(got ['label', 'pixels'])"],
    ),
    Case(
        "data-columns-without-hf-datasets",
        mutate({"data.format": "imagefolder", "data.columns": {"image": "img", "label": "label"}}),
        ["error: {path}: data.columns: only used with format instructions or hf-datasets (format is imagefolder)"],
    ),
    Case(
        "data-path-empty",
        mutate({"data.format": "imagefolder", "data.path": "", "data.image_size": 224}),
        ["error: {path}: data.path: give a file or folder (got '')"],
    ),
    Case(
        "custom-task-without-loss",
        mutate({"task": "custom"}),
        ["error: {path}: loss: task custom needs loss:"],
    ),
    Case(
        "loss-without-custom-task",
        mutate({"loss": {"factory": "a.b:c"}}),
        ["error: {path}: loss: builtin and factory only with task custom"],
    ),
    Case(
        "unknown-task",
        mutate({"task": "detection"}),
        ["error: {path}: task: expected one of", "(got 'detection')"],
    ),
    Case(
        "unknown-norm-layer",
        mutate({"model.norm_layers": ["batchnrm"]}),
        ["error: {path}: model.norm_layers.0: expected one of 'batchnorm'", "(got 'batchnrm')"],
    ),
    Case(
        "unknown-norm-layer-given-alone",
        mutate({"model.norm_layers": "batchnrm"}),
        ["error: {path}: model.norm_layers.0: expected one of 'batchnorm'", "(got 'batchnrm')"],
    ),
    # ---- model.lora and model.dtype --------------------------------------------------------------------
    Case(
        "lora-rank-zero",
        mutate({"model.lora": {"r": 0, "target_modules": ["fc"]}}),
        ["error: {path}: model.lora.r: must be > 0 (got 0)"],
    ),
    Case(
        "lora-rank-not-integer",
        mutate({"model.lora": {"r": 4.5, "target_modules": ["fc"]}}),
        ["error: {path}: model.lora.r: expected an integer (got 4.5)"],
    ),
    Case(
        "lora-without-target-modules",
        mutate({"model.lora": {"r": 4}}),
        ["error: {path}: model.lora.target_modules: required field is missing"],
    ),
    Case(
        "lora-empty-target-modules",
        mutate({"model.lora": {"r": 4, "target_modules": []}}),
        ["error: {path}: model.lora.target_modules: expected at least 1 item (got [])"],
    ),
    Case(
        "lora-dropout-one",
        mutate({"model.lora": {"r": 4, "dropout": 1.0, "target_modules": ["fc"]}}),
        ["error: {path}: model.lora.dropout: must be < 1.0 (got 1.0)"],
    ),
    Case(
        "lora-unknown-key",
        mutate({"model.lora": {"rank": 4, "target_modules": ["fc"]}}),
        ["error: {path}: model.lora.rank: unknown key (known: r, alpha, dropout, target_modules, dtype)"],
        lines=2,  # and r is missing
    ),
    Case(
        "lora-not-a-mapping",
        mutate({"model.lora": 8}),
        ["error: {path}: model.lora: expected a mapping (got 8)"],
    ),
    Case(
        "dtype-typo",
        mutate({"model.dtype": "bf61"}),
        ["error: {path}: model.dtype: expected one of 'fp32', 'bf16' or 'fp16' (got 'bf61')"],
    ),
    Case(
        "bf16-weights-under-fp32-precision",
        mutate({"model.dtype": "bf16"}),
        ["error: {path}: model.dtype: bf16 weights compute under precision: bf16 (autocast), not fp32"],
    ),
    Case(
        "fp16-weights-trained-in-full",
        mutate({"model.dtype": "fp16", "precision": "fp16"}),
        ["error: {path}: model.dtype: fp16 weights can only stay frozen under model.lora"],
    ),
    # ---- plan-only data the probe cannot give a shape ----------------------------------------------------
    Case(
        "probe-image-size-unknown",
        mutate({"data.name": "my-photos"}),
        ["error: data: 'my-photos' is not available here and its image shape is not known: give data.image_size",
         "(or give --micro-batch-max to skip the probe)"],
        args=("--gpu", "rtx4090"),
    ),
    Case(
        "probe-tokens-without-length",
        mutate({"task": "language-modeling", "model": {"builtin": "gpt2-124m"}, "data.name": "web-text",
                "reported": DELETE}),
        ["error: batch.sequence_length: needed to probe with synthetic tokens", "data.max_length"],
        args=("--gpu", "rtx4090"),
    ),
    Case(
        "probe-sequence-longer-than-the-model",
        mutate({"task": "language-modeling", "model": {"builtin": "gpt2-124m"}, "data.name": "web-text",
                "data.max_length": 4096, "reported": DELETE}),
        ["error: data.max_length: 4096 tokens is longer than gpt2-124m takes (1024 positions)"],
        args=("--gpu", "rtx4090"),
    ),
    Case(
        "bad-precision",
        mutate({"precision": "fp8"}),
        ["error: {path}: precision: expected one of 'fp32', 'bf16' or 'fp16' (got 'fp8')"],
    ),
    Case(
        "duplicate-key",
        GOYAL.replace("lr: 3.2,", "lr: 3.2, lr: 0.1,"),
        ["error: {path}: YAML syntax error at line", "duplicate key 'lr'"],
    ),
    Case("plan-file-as-recipe", None, ["error: {path}: this is a plan file, not a recipe"]),
    # ---- several problems in one file: all reported at once, one line each ----------------------------
    Case(
        "several-errors",
        mutate({"batch.effective": -1, "optimizer.lr": "x", "precision": "fp8", "bogus": 1}),
        ["error: {path}: batch.effective: must be > 0 (got -1)"],
        lines=4,
    ),
    # ---- optimizers, batch phases and ramps ------------------------------------------------------------
    Case(
        "trust-coefficient-not-lars",
        mutate({"optimizer.trust_coefficient": 0.01}),
        ["error: {path}: optimizer.trust_coefficient: only used by lars (name is nesterov)"],
    ),
    Case(
        "trust-coefficient-zero",
        mutate({"optimizer.name": "lars", "optimizer.trust_coefficient": 0}),
        ["error: {path}: optimizer.trust_coefficient: must be > 0", "(got 0)"],
    ),
    Case(
        "one-phase",
        mutate({"batch.phases": [{"effective": 8192}]}),
        ["error: {path}: batch.phases: give two phases or more (one phase is batch.effective alone)"],
    ),
    Case(
        "last-phase-with-length",
        mutate({"batch.phases": [{"epochs": 10, "effective": 4096}, {"epochs": 80, "effective": 8192}]}),
        ["error: {path}: batch.phases.1.epochs: the last phase runs to the end of schedule.total; give it no length"],
    ),
    Case(
        "phase-without-length",
        mutate({"batch.phases": [{"effective": 4096}, {"effective": 8192}]}),
        ["error: {path}: batch.phases.0: give its length: exactly one of steps, epochs, samples, tokens (got none)"],
    ),
    Case(
        "main-batch-not-a-phase",
        mutate({"batch.phases": [{"epochs": 10, "effective": 4096}, {"effective": 16384}]}),
        ["error: {path}: batch.effective: 8192 is none of the phases' batches (4096, 16384)"],
    ),
    Case(
        "phase-length-without-batch-length",
        mutate({"batch.phases": [{"epochs": 10, "effective": 4096, "sequence_length": 128}, {"effective": 8192}]}),
        ["error: {path}: batch.phases.0.sequence_length: needs batch.sequence_length"],
    ),
    Case(
        "phases-and-ramp",
        mutate({"batch.phases": [{"epochs": 10, "effective": 4096}, {"effective": 8192}],
                "batch.ramp": {"start": 256, "length": {"epochs": 5}}}),
        ["error: {path}: batch.phases: give phases or ramp, not both"],
    ),
    Case(
        "ramp-start-above-batch",
        mutate({"batch.ramp": {"start": 9000, "length": {"epochs": 5}}}),
        ["error: {path}: batch.ramp.start: 9000 must be below the batch it ramps up to, effective 8192"],
    ),
    Case(
        "ramp-without-length",
        mutate({"batch.ramp": {"start": 256}}),
        ["error: {path}: batch.ramp.length: required field is missing"],
    ),
    Case(
        "phase-unknown-key",
        mutate({"batch.phases": [{"epochs": 10, "effective": 4096, "sequence": 3}, {"effective": 8192}]}),
        ["error: {path}: batch.phases.0.sequence: unknown key (did you mean 'sequence_length'?)"],
    ),
    # ---- options ---------------------------------------------------------------------------------------
    Case(
        "micro-batch-max-zero",
        GOYAL,
        ["error: ", "'--micro-batch-max'", "greater than or equal to 1"],
        args=("--micro-batch-max", "0"),
    ),
    Case(
        "micro-batch-max-not-int",
        GOYAL,
        ["error: ", "'--micro-batch-max'", "integer"],
        args=("--micro-batch-max", "abc"),
    ),
    Case("micro-batch-max-missing", GOYAL, ["error: --micro-batch-max: required"], args=()),
    Case(
        "world-size-zero",
        GOYAL,
        ["error: ", "'--world-size'", "greater than or equal to 1"],
        args=(*OK_ARGS, "--world-size", "0"),
    ),
    Case(
        "world-size-above-effective-batch",
        GOYAL,
        ["error: --world-size: 10000 processes exceed the paper's effective batch of 8192 samples"],
        args=(*OK_ARGS, "--world-size", "10000"),
    ),
    Case(
        "sharding-fsdp-one-process",
        GOYAL,
        ["error: --sharding fsdp: shards the model over the --world-size processes, and --world-size is 1"],
        args=(*OK_ARGS, "--sharding", "fsdp"),
    ),
    Case(
        "sharding-fsdp-without-budget",
        GOYAL,
        ["error: --memory or --gpu: required with fsdp sharding"],
        args=("--sharding", "fsdp", "--world-size", "4"),
    ),
    Case("sharding-bogus", GOYAL, ["error: ", "'--sharding'", "'zero3'"], args=(*OK_ARGS, "--sharding", "zero3")),
    Case(
        "sharding-fsdp-cpu-meter",
        GOYAL,
        ["error: --meter cpu: measures one whole process and cannot shard"],
        args=("--sharding", "fsdp", "--world-size", "4", "--meter", "cpu", "--memory", "1GiB"),
    ),
    Case(
        "recipe-sharding-bogus",
        mutate({"batch.sharding": "zero3"}),
        ["error: {path}: batch.sharding: expected one of 'none' or 'fsdp' (got 'zero3')"],
    ),
    Case("gpu-is-a-tpu", GOYAL, ["error: --gpu: 'TPUv3' is a TPU, not a GPU"], args=("--gpu", "TPUv3")),
    Case(
        "recipe-pretrained-empty",
        mutate({"model.pretrained": ""}),
        ["error: {path}: model.pretrained:"],
    ),
    Case(
        "policy-bogus",
        GOYAL,
        ["error: ", "'--policy'", "'bogus'", "exact", "fast"],
        args=(*OK_ARGS, "--policy", "bogus"),
    ),
    Case("unknown-option", GOYAL, ["error: No such option: --bogus"], args=(*OK_ARGS, "--bogus")),
    Case("recipe-argument-missing", None, ["error: Missing argument 'RECIPE'"], recipe_arg=None),
]


def _setup(case: Case, root: Path) -> str:
    """Write the case's recipe under `root`; the RECIPE argument as the CLI gets it (relative to root)."""
    path = root / RECIPE
    path.parent.mkdir(parents=True, exist_ok=True)
    if case.id == "plan-file-as-recipe":
        path.write_text(GOYAL, encoding="utf-8")
        assert main_in_process(["plan", RECIPE, *OK_ARGS, "--out", RECIPE + ".plan"], root)[0] == 0
        (root / (RECIPE + ".plan")).replace(path)
    elif case.text == "<dir>":
        path.mkdir()
    elif case.text is not None:
        path.write_bytes(case.text.encode("utf-8", errors="surrogateescape"))
    return RECIPE


def main_in_process(argv: list[str], cwd: Path, capsys=None) -> tuple[int, str, str]:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        main(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(old)
    if capsys is None:
        return code, "", ""
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _argv(case: Case) -> list[str]:
    return ["plan", *([case.recipe_arg] if case.recipe_arg else []), *case.args]


def check(case: Case, code: int, out: str, err: str) -> None:
    shown = f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    assert "Traceback" not in out + err, shown
    assert code == 2, shown
    assert out == "", shown
    lines = err.splitlines()
    assert lines, shown
    assert all(line.startswith("error: ") for line in lines), shown
    assert len(lines) == len(set(lines)), shown
    if case.lines is not None:
        assert len(lines) == case.lines, shown
    wanted = [part.format(path=RECIPE) for part in case.expect]
    assert any(all(part in line for part in wanted) for line in lines), (
        f"no line has all of {wanted}\n{shown}"
    )


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_input_in_process(case: Case, tmp_path, capsys):
    _setup(case, tmp_path)
    capsys.readouterr()
    code, out, err = main_in_process(_argv(case), tmp_path, capsys)
    check(case, code, out, err)


def test_corpus_is_large_and_ids_unique():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


def test_several_errors_one_line_each(tmp_path, capsys):
    text = mutate(
        {
            "batch.effective": -1,
            "optimizer.lr": "x",
            "precision": "fp8",
            "optimiser": 1,
            "schedule.warmup.epoch": 2,
        }
    )
    (tmp_path / "papers").mkdir()
    (tmp_path / RECIPE).write_text(text, encoding="utf-8")
    capsys.readouterr()
    code, out, err = main_in_process(["plan", RECIPE, *OK_ARGS], tmp_path, capsys)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        f"error: {RECIPE}: batch.effective: must be > 0 (got -1)",
        f"error: {RECIPE}: optimizer.lr: expected a number (got 'x')",
        f"error: {RECIPE}: schedule.warmup.epoch: unknown key (did you mean 'epochs'?)",
        f"error: {RECIPE}: precision: expected one of 'fp32', 'bf16' or 'fp16' (got 'fp8')",
        f"error: {RECIPE}: optimiser: unknown key (did you mean 'optimizer'?)",
    ]


# ---- nothing on disk lost or overwritten ----------------------------------------------------------------

EXISTING = b"# my previous plan, hand-tuned\nformat: reproduce-plan/1\nmicro_batch: 7\n"


@pytest.mark.parametrize(
    "text, args",
    [
        pytest.param(mutate({"optimizer.lr": "fast"}), OK_ARGS, id="bad-recipe"),
        pytest.param("batch: [1, 2\n", OK_ARGS, id="malformed-yaml"),
        pytest.param(GOYAL, (*OK_ARGS, "--world-size", "10000"), id="bad-world-size"),
        pytest.param(GOYAL, ("--micro-batch-max", "0"), id="bad-micro-batch-max"),
        pytest.param(GOYAL, (), id="missing-micro-batch-max"),
    ],
)
def test_existing_out_file_untouched(text, args, tmp_path, capsys):
    (tmp_path / "papers").mkdir()
    (tmp_path / RECIPE).write_text(text, encoding="utf-8")
    existing = tmp_path / "existing.yaml"
    existing.write_bytes(EXISTING)
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    code, out, err = main_in_process(["plan", RECIPE, *args, "--out", "existing.yaml"], tmp_path, capsys)
    assert code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err
    assert existing.read_bytes() == EXISTING
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left behind
    assert (tmp_path / RECIPE).read_text(encoding="utf-8") == text


def test_out_onto_the_recipe_is_refused(tmp_path, capsys):
    (tmp_path / "papers").mkdir()
    (tmp_path / RECIPE).write_text(GOYAL, encoding="utf-8")
    capsys.readouterr()
    code, out, err = main_in_process(["plan", RECIPE, *OK_ARGS, "--out", RECIPE], tmp_path, capsys)
    assert (tmp_path / RECIPE).read_text(encoding="utf-8") == GOYAL
    assert code == 2 and err.startswith("error: --out: ")


# ---- the real entry point, in a subprocess ---------------------------------------------------------------


def _script() -> str:
    script = shutil.which("reproduce", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the `reproduce` console script is not installed next to this python")
    return script


def _run_script(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_script(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


SUBPROCESS_CASES = {c.id: c for c in CASES}


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "case_id",
    ["malformed-yaml", "several-errors", "world-size-above-effective-batch", "policy-bogus", "missing-file"],
)
def test_bad_input_real_entry_point(case_id, tmp_path):
    case = SUBPROCESS_CASES[case_id]
    _setup(case, tmp_path)
    result = _run_script(_argv(case), tmp_path)
    check(case, result.returncode, result.stdout, result.stderr)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "make_out",
    [
        pytest.param(
            lambda root: (root / "plans").mkdir() or "plans",
            id="out-is-a-directory",
        ),
        pytest.param(
            lambda root: (root / "afile").write_text("x") and "afile/plan.yaml",
            id="out-parent-is-a-file",
        ),
    ],
)
def test_unwritable_out_real_entry_point(make_out, tmp_path):
    (tmp_path / "papers").mkdir()
    (tmp_path / RECIPE).write_text(GOYAL, encoding="utf-8")
    out = make_out(tmp_path)
    result = _run_script(["plan", RECIPE, *OK_ARGS, "--out", out], tmp_path)
    shown = f"exit {result.returncode}\n{result.stderr}"
    assert "Traceback" not in result.stderr, shown
    assert result.returncode == 2, shown
    assert result.stderr.startswith("error: --out: "), shown
    assert out.split("/")[0] in result.stderr, shown
    assert len(result.stderr.splitlines()) == 1, shown


# ---- plan files edited by hand ----------------------------------------------------------------------------


@pytest.fixture
def plan_data(tmp_path, capsys) -> dict:
    """A plan written by `reproduce plan --out`, as a dict to edit."""
    (tmp_path / "papers").mkdir()
    (tmp_path / RECIPE).write_text(GOYAL, encoding="utf-8")
    code, _, err = main_in_process(["plan", RECIPE, *OK_ARGS, "--out", "plan.yaml"], tmp_path, capsys)
    assert code == 0, err
    load_plan(tmp_path / "plan.yaml")  # the unedited plan loads
    return yaml.safe_load((tmp_path / "plan.yaml").read_text(encoding="utf-8"))


def _edit(data: dict, **changes) -> dict:
    data = copy.deepcopy(data)
    data.update(changes)
    return data


def _split(data: dict, **changes) -> dict:
    """The plan with its split (micro-batch x accumulation x world size) edited by hand, its segment left as is."""
    return _edit(data, split={**data["split"], **changes})


WHOLE = ("{p}: segments[0]: the whole run at the split's batch: expected (start_step, steps, micro_batch, "
         "accumulation_steps, effective_batch) {wanted}, got (0, None, 8, 1024, 8192)")
PLAN_EDITS = [
    pytest.param(
        lambda d: _split(d, accumulation_steps=d["split"]["accumulation_steps"] + 1),
        [
            "{p}: split.effective_batch: micro_batch x accumulation_steps x world_size = 8 x 1025 x 1 = 8200, "
            "not 8192",
            WHOLE.replace("{wanted}", "(0, None, 8, 1025, 8192)"),
        ],
        id="accumulation-changed",
    ),
    pytest.param(
        lambda d: _split(d, world_size=2),
        [
            "{p}: split.effective_batch: micro_batch x accumulation_steps x world_size = 8 x 1024 x 2 = 16384, "
            "not 8192"
        ],
        id="world-size-changed",
    ),
    pytest.param(
        lambda d: _split(d, exact=False),
        ["{p}: split.exact: False contradicts effective_batch 8192 vs the paper's 8192"],
        id="exact-flipped",
    ),
    pytest.param(
        lambda d: _split(d, exact=False, accumulation_steps=3),
        [
            "{p}: split.effective_batch: micro_batch x accumulation_steps x world_size = 8 x 3 x 1 = 24, not 8192",
            "{p}: split.exact: False contradicts effective_batch 8192 vs the paper's 8192",
            WHOLE.replace("{wanted}", "(0, None, 8, 3, 8192)"),
        ],
        id="both-at-once",
    ),
    pytest.param(
        lambda d: _split(d, lr=1.0),
        ["{p}: split.lr: expected the recipe's lr x lr_factor = 3.2 (got 1)",
         "{p}: schedule: starts at step 0 with the split's lr 1 (got step 0, lr 3.2)"],
        id="lr-edited",
    ),
    pytest.param(
        lambda d: _split(d, micro_batch=0), ["{p}: split.micro_batch: must be >= 1 (got 0)"], id="micro-batch-zero"
    ),
    pytest.param(
        lambda d: _split(d, micro_batch="big"),
        ["{p}: split.micro_batch: expected an integer (got 'big')"],
        id="micro-batch-string",
    ),
    pytest.param(
        lambda d: _edit(d, micro_batch_mx=3),
        ["{p}: micro_batch_mx: unknown key (did you mean 'micro_batch_max'?)"],
        id="unknown-key",
    ),
    pytest.param(
        lambda d: _edit(d, format="x"),
        ["{p}: format: expected 'reproduce-plan/2' (got 'x'); is this a recipe?"],
        id="format-changed",
    ),
    pytest.param(
        lambda d: _edit(d, recipe={**d["recipe"], "batch": {**d["recipe"]["batch"], "effective": -1}}),
        ["{p}: recipe: batch.effective: must be > 0 (got -1)"],
        id="recipe-inside-broken",
    ),
    pytest.param(
        lambda d: _edit(d, segments=[]), ["{p}: segments: a plan has at least one segment; plan it again"],
        id="no-segment",
    ),
]


@pytest.mark.parametrize("edit, expected", PLAN_EDITS)
def test_hand_edited_plan_rejected(edit, expected, plan_data, tmp_path):
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(edit(plan_data), sort_keys=False), encoding="utf-8")
    with pytest.raises(UserError) as info:
        load_plan(path)
    assert info.value.lines == [line.format(p=path) for line in expected]


PAPERS = Path(__file__).resolve().parents[2] / "papers"


def test_throughput_under_the_estimate_meter_without_a_gpu_is_one_line(tmp_path, capsys):
    """The FLOPs model ranks splits by a GPU's peak; with none named it refuses in one line (it raised a pydantic
    ValidationError with a traceback, and before that ranked FLOPs as if they were seconds)."""
    code, out, err = main_in_process(["plan", str(PAPERS / "pysource-gpt.yaml"), "--policy", "throughput",
                                      "--meter", "estimate", "--memory", "2GiB"], tmp_path, capsys)
    assert (code, out) == (2, ""), err
    assert "Traceback" not in err and err.splitlines()[-1] == (
        "error: --policy throughput: the estimate meter times nothing, and the FLOPs model needs a GPU's peak (no GPU "
        "is named): give --gpu NAME, or probe with --meter cuda | cpu to time the splits")
    code, out, err = main_in_process(["plan", str(PAPERS / "pysource-gpt.yaml"), "--policy", "throughput",
                                      "--meter", "estimate", "--gpu", "a100-80gb"], tmp_path, capsys)
    assert code == 0 and "--policy throughput (a model: nothing timed)" in err + out


def test_throughput_with_batch_phases_is_refused_before_any_probe(tmp_path, capsys):
    """Each phase's probe (and, under the estimate meter, its throughput plan, which raised a traceback) ran before
    the refusal did: now nothing is probed."""
    code, out, err = main_in_process(["plan", str(PAPERS / "pysource-gpt-phases.yaml"), "--policy", "throughput",
                                      "--meter", "estimate", "--memory", "2GiB"], tmp_path, capsys)
    assert (code, out) == (2, ""), err
    assert err.splitlines() == ["error: --policy throughput: not available with batch phases or a ramp (each phase "
                                "has its own split); use --policy exact"]
