"""BatchNorm choices in a run: group and frozen take the batch out of the statistics, so accumulation is the large
batch again (float64, against the plain loop); sync refused on one process and on the CPU in one line; frozen from
random weights warned; the choice printed and recorded in plan.yaml and summary.json."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from torch import nn

from helpers import SGD, assert_same_weights, cli, digits_recipe, run_accumulated, run_plain, snapshot
from reproduce.errors import UserError
from reproduce.train.distributed.processes import World
from reproduce.train.setup import check_sync_batchnorm


@pytest.mark.parametrize("mode", ["group", "frozen"])
def test_group_and_frozen_accumulate_to_the_large_batch_float64(mode, tmp_path):
    recipe = digits_recipe(SGD, model="cnn-bn", effective=32, steps=3)
    recipe["model"]["batchnorm"] = mode
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    assert plan.batchnorm_warning is None and plan.batchnorm.run_batch is None and plan.batchnorm.layers == 3
    assert summary["batchnorm"]["mode"] == mode and summary["batchnorm"]["run_batch"] is None
    assert not any(name.endswith("num_batches_tracked") for name in ours)  # no BatchNorm left
    assert any(name.endswith("running_mean") for name in ours) == (mode == "frozen")  # frozen keeps its statistics
    assert_same_weights(ours, run_plain(recipe, data, steps=3), rtol=1e-9, atol=1e-12)


def test_sync_is_refused_on_one_process_and_on_the_cpu():
    with pytest.raises(UserError, match="this run has one: launch it with `world_size` N"):
        check_sync_batchnorm(World(), torch.device("cpu"))
    with pytest.raises(UserError, match=r"sync needs CUDA \(torch.nn.SyncBatchNorm runs on CUDA only"):
        check_sync_batchnorm(World(rank=0, size=2), torch.device("cpu"))
    # (build checks sync alone: group and frozen run above, and keep is every BatchNorm recipe's default)


def write(tmp_path, recipe: dict):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.mark.parametrize("processes, flag, said", [
    # one process has nothing to synchronise over; the line names the field as the user gave it
    ([], ["--batchnorm", "sync"], "error: --batchnorm: sync normalises over the micro-batches of several processes"),
    ([], [], "error: model.batchnorm: sync normalises over the micro-batches of several processes"),  # the recipe's
    (["--nproc-per-node", "2"], ["--batchnorm", "sync"], "sync needs CUDA"),  # refused before any launch
])
def test_cli_sync_is_one_line_nothing_written(processes, flag, said, tmp_path, capsys):
    recipe = digits_recipe(SGD, model="cnn-bn", effective=32, steps=2)
    if not flag:
        recipe["model"]["batchnorm"] = "sync"
    path = write(tmp_path, recipe)
    out = tmp_path / "out"
    code, _, err = cli(capsys, "run", path, "--out", out, "--micro-batch-max", "8", "--device", "cpu", *processes,
                       *flag)
    assert code == 2 and err.strip().count("\n") == 0 and said in err, err
    assert "--world-size N on N GPUs, or give --batchnorm keep | frozen | group" in err or processes, err
    assert snapshot(out) == {}


def test_cli_frozen_warns_and_records_the_choice(tmp_path, capsys):
    path = write(tmp_path, digits_recipe(SGD, model="cnn-bn", effective=32, steps=2))
    out = tmp_path / "out"
    code, printed, err = cli(capsys, "run", path, "--out", out, "--micro-batch-max", "8", "--device", "cpu",
                             "--batchnorm", "frozen")
    assert code == 0, err
    said = printed + err
    assert "BatchNorm (frozen): 3 BatchNorm layers (known for the built-in cnn-bn) as FrozenBatchNorm2d" in said
    assert "from random weights they are mean 0, variance 1" in said
    saved = yaml.safe_load((out / "plan.yaml").read_text())
    assert saved["recipe"]["model"]["batchnorm"] == "frozen" and saved["batchnorm"]["paper_mode"] == "keep"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["batchnorm"]["mode"] == "frozen"
    code, _, err = cli(capsys, "run", out / "plan.yaml", "--out", tmp_path / "again", "--batchnorm", "group")
    assert code == 2 and "--batchnorm: the plan was made with model.batchnorm frozen" in err


def test_verify_says_equivalent_with_group_norm(tmp_path, capsys):
    path = write(tmp_path, digits_recipe(SGD, model="cnn-bn", effective=32, steps=2))
    code, printed, err = cli(capsys, "verify", path, "--micro-batch-max", "8", "--batchnorm", "group", "--json")
    assert code == 0, err
    assert json.loads(printed)["equivalent"] is True and json.loads(printed)["batchnorm"] is False
    code, printed, _ = cli(capsys, "verify", path, "--micro-batch-max", "8", "--json")
    assert code == 1 and json.loads(printed)["batchnorm"] is True


def test_sync_conversion_keeps_the_weights():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    synced = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    assert isinstance(synced[1], nn.SyncBatchNorm)
    assert synced.state_dict().keys() == nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).state_dict().keys()
