"""BatchNorm in the plan: the layers found in the model (not in the label), the run's BN batch against the paper's
(per device and synced), the options that bring it closer, and --batchnorm recorded in the plan."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from helpers import cli, with_batchnorm
from reproduce.data import Datasets
from reproduce.errors import UserError
from reproduce.models import MODELS, count_batchnorm
from reproduce.plan import builtin_names
from reproduce.plan.batchnorm import AUX_HEAD_LAYERS, BUILTIN_LAYERS
from reproduce.plan.planner import make_plan
from reproduce.plan.recipe import parse_recipe


def recipe(model: dict, batch: dict | None = None, **extra):
    return parse_recipe({
        "batch": batch or {"effective": 16, "per_device": 16},
        "task": "classification",
        "model": model,
        "data": {"name": "voc", "available": False, "classes": 21, "image_size": 513, "channels": 3},
        "optimizer": {"name": "sgd", "lr": 0.007, "momentum": 0.9},
        "schedule": {"total": {"steps": 100}},
        **extra,
    })


def test_the_known_counts_are_the_built_models():
    assert set(BUILTIN_LAYERS) == set(builtin_names.MODELS)
    for name, layers in BUILTIN_LAYERS.items():
        with torch.device("meta"):
            assert count_batchnorm(MODELS[name]()) == layers, name
    with torch.device("meta"):
        with_aux = MODELS["deeplabv3-resnet50"](aux_loss=True)
    assert count_batchnorm(with_aux) == BUILTIN_LAYERS["deeplabv3-resnet50"] + AUX_HEAD_LAYERS


@pytest.mark.parametrize("label", [[], ["groupnorm"]])
def test_batchnorm_found_in_the_model_not_the_label(label):
    """A DeepLabV3 recipe unlabelled or labelled groupnorm still plans as a BatchNorm model."""
    p = make_plan(recipe({"builtin": "deeplabv3-resnet50", "norm_layers": label}), micro_batch_max=2)
    assert p.batchnorm.layers == 60 and p.batchnorm.run_batch == 2 and p.batchnorm.paper_batch == 16
    assert "BatchNorm statistics will be computed over micro-batches of 2 samples instead of the paper's " \
           "per-device 16" in p.batchnorm_warning
    disagree = [w for w in p.warnings if w.startswith("model.norm_layers:")]
    assert disagree == ([] if not label else [
        "model.norm_layers: the recipe labels deeplabv3-resnet50 ['groupnorm'], but it has 60 BatchNorm layers "
        "(known for the built-in deeplabv3-resnet50): planned as a BatchNorm model"])


def test_a_label_that_claims_batchnorm_the_model_lacks():
    p = make_plan(recipe({"builtin": "vit-b16", "norm_layers": "batchnorm"}), micro_batch_max=4)
    assert p.batchnorm is None and p.batchnorm_warning is None
    assert "model.norm_layers: the recipe lists batchnorm, but vit-b16 has no BatchNorm layer" in " ".join(p.warnings)


def test_counted_layers_of_a_factory_model_win_over_its_label():
    spec = {"factory": "factories:torchvision_resnet50", "norm_layers": "layernorm"}
    assert make_plan(recipe(spec), micro_batch_max=2).batchnorm is None  # not built: the label is all there is
    p = make_plan(recipe(spec), micro_batch_max=2, batchnorm_layers=53)
    assert p.batchnorm.layers == 53 and p.batchnorm.found == "counted in the built model" and p.batchnorm_warning


def test_the_plan_counts_a_factory_models_batchnorm_without_the_probe(tmp_path, capsys):
    spec = {"factory": "factories:torchvision_resnet50", "norm_layers": "layernorm"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(spec).model_dump(mode="json", exclude_none=True)))
    code, printed, err = cli(capsys, "plan", path, "--micro-batch-max", "2", "--json")
    assert code == 0, err
    norm = json.loads(printed)["norm"]
    assert norm["layers"] == 53 and norm["found"] == "counted in the built model"
    assert "labels factories:torchvision_resnet50 ['layernorm'], but it has 53 BatchNorm layers" in printed + err


def test_the_options_and_what_each_needs():
    p = make_plan(recipe({"builtin": "deeplabv3-resnet50"}), micro_batch_max=2)
    assert (p.micro_batch, p.accumulation_steps) == (2, 8)
    options = " | ".join(p.batchnorm.options)
    assert "keep with micro-batch 16 per device: the paper's BN batch (the largest that fits is 2)" in options
    assert "sync over 8 CUDA processes (--world-size 8 --batchnorm sync): micro-batch 2 x 8 = 16" in options
    assert "group (--batchnorm group)" in options and "frozen (--batchnorm frozen)" in options
    four = make_plan(recipe({"builtin": "deeplabv3-resnet50"}), micro_batch_max=2, world_size=4)
    assert "sync over the run's 4 CUDA processes (--batchnorm sync): BN batch 2 x 4 = 8, against the paper's 16" in (
        four.batchnorm.options)
    assert not any("run's" in option for option in p.batchnorm.options)  # one process: nothing of its own to sync
    fits = make_plan(recipe({"builtin": "deeplabv3-resnet50"}), micro_batch_max=16)
    assert fits.micro_batch == 16 and fits.batchnorm.run_batch == 16 and not fits.batchnorm.options
    assert fits.batchnorm_warning is None


def test_sync_bn_batch_is_micro_batch_times_processes():
    """MMSegmentation's 4xb2 with SyncBN: the paper's BN batch is 2 x 4 = 8; so is the run's on 4 processes."""
    mmseg = recipe({"builtin": "deeplabv3-resnet50", "batchnorm": "sync", "aux_weight": 0.4},
                   batch={"effective": 8, "devices": 4, "per_device": 2})
    four = make_plan(mmseg, micro_batch_max=4, world_size=4)
    norm = four.batchnorm
    assert (four.micro_batch, norm.run_batch, norm.paper_batch, norm.layers) == (2, 8, 8, 61)
    assert four.batchnorm_warning is None and not four.batchnorm.options
    one = make_plan(mmseg, micro_batch_max=4)
    assert one.batchnorm.run_batch == 4 and "`reproduce run` refuses it" in " ".join(one.warnings)
    kept = make_plan(with_batchnorm(mmseg, "keep"), micro_batch_max=2)
    norm = kept.batchnorm
    assert (norm.mode, norm.paper_mode, norm.run_batch, norm.paper_batch) == ("keep", "sync", 2, 8)
    assert kept.recipe.model.paper_batchnorm == "sync"


def test_a_bn_batch_of_one_is_refused_where_image_pooling_needs_two():
    with pytest.raises(UserError, match="image pooling normalises a 1 x 1 map"):
        make_plan(recipe({"builtin": "deeplabv3-resnet50"}), micro_batch_max=1)
    grouped = with_batchnorm(recipe({"builtin": "deeplabv3-resnet50"}), "group")
    assert make_plan(grouped, micro_batch_max=1).micro_batch == 1
    with torch.device("meta"), pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        MODELS["deeplabv3-resnet50"]().train()(torch.randn(1, 3, 33, 33))  # what the refusal spares the run


def test_the_probe_plans_a_deeplab_workload_without_a_bn_batch_of_one():
    from reproduce.probe.workload import Workload

    deeplab = recipe({"builtin": "deeplabv3-resnet50"}, batch={"effective": 16, "per_device": 2})
    assert Workload(deeplab, data=Datasets(list(range(32)))).plan.micro_batch == 2


def test_group_is_a_deviation_and_frozen_is_warned():
    group = make_plan(with_batchnorm(recipe({"builtin": "deeplabv3-resnet50"}), "group"), micro_batch_max=2)
    assert group.batchnorm.run_batch is None and group.batchnorm_warning is None
    assert any(w.startswith("deviation from the paper: GroupNorm in place of its BatchNorm") for w in group.warnings)
    assert not [o for o in group.batchnorm.options if o.startswith("group")]
    frozen = make_plan(with_batchnorm(recipe({"builtin": "deeplabv3-resnet50"}), "frozen"), micro_batch_max=2)
    assert any("from random weights they are mean 0, variance 1" in w for w in frozen.warnings)


def test_policy_never_changes_the_bn_batch_silently():
    """The exact split takes the paper's BN batch per device when it fits; when it does not, the plan says so."""
    spec = recipe({"builtin": "resnet50"}, batch={"effective": 256, "devices": 4, "per_device": 64})
    exact = make_plan(spec, micro_batch_max=200)
    assert exact.micro_batch == 64 and exact.batchnorm_warning is None  # not 128, the largest split that fits
    for policy in ("exact", "fast"):
        smaller = make_plan(spec, micro_batch_max=48, policy=policy)
        assert smaller.micro_batch < 64 and "instead of the paper's per-device 64" in smaller.batchnorm_warning
        assert smaller.batchnorm_warning in smaller.warnings


def test_plan_prints_and_records_the_choice(tmp_path, capsys):
    path = tmp_path / "deeplab.yaml"
    data = {"batch": {"effective": 16, "per_device": 16}, "task": "classification",
            "model": {"builtin": "deeplabv3-resnet50", "output_stride": 16},
            "data": {"name": "voc", "available": False, "classes": 21, "image_size": 513, "channels": 3},
            "optimizer": {"name": "sgd", "lr": 0.007}, "schedule": {"total": {"steps": 100}}}
    path.write_text(yaml.safe_dump(data))
    out = tmp_path / "plan.yaml"
    code, output, err = cli(capsys, "plan", path, "--micro-batch-max", "2", "--batchnorm", "group", "--out", out)
    assert code == 0, err
    assert "group, no BN batch; 60 BatchNorm layers" in output and "BN batch 16 per device" in output
    saved = yaml.safe_load(out.read_text())
    assert saved["recipe"]["model"]["batchnorm"] == "group" and saved["recipe"]["model"]["paper_batchnorm"] == "keep"
    assert saved["batchnorm"]["mode"] == "group" and saved["batchnorm"]["paper_batch"] == 16


@pytest.mark.parametrize(("mode", "samples"), [("keep", 2), ("group", 1)])
def test_flops_counted_on_two_crops_where_image_pooling_needs_them(mode, samples, monkeypatch):
    from reproduce.probe import flops

    seen = []
    monkeypatch.setattr(flops, "count_flops", lambda recipe, info, batch: seen.append(len(batch[1])))
    deeplab = recipe({"builtin": "deeplabv3-resnet50", "batchnorm": mode}, batch={"effective": 16, "per_device": 2})
    flops.recipe_flops(deeplab, data=Datasets([(torch.zeros(3, 8, 8), 0)] * 4))
    assert seen == [samples]
