"""Task segmentation's loss: per-pixel cross-entropy over the pixels not at ignore_index, the window's sum
divided by the window's valid pixels, the auxiliary head's term included. In float64 against one pass over the whole
batch: the plan's normalisation is exact when micro-batches hold different valid-pixel counts; MMSegmentation's
per-micro-batch mean (accumulative_counts, avg_non_ignore=True or F.cross_entropy's default mean) is not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from helpers import cli
from reproduce.data import build_data
from reproduce.data.loader import fetch_seeded
from reproduce.data.samples import write_voc
from reproduce.models import build_model
from reproduce.plan.recipe import parse_recipe
from reproduce.train.losses import PixelLoss, build_loss


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    return Path(write_voc(tmp_path_factory.mktemp("scenes") / "voc", train=12, val=4)["path"])


def recipe_for(path: Path, model: dict, crop: int = 24, effective: int = 6) -> dict:
    return {
        "batch": {"effective": effective},
        "task": "segmentation",
        "model": model,
        "data": {"format": "segmentation", "path": str(path), "classes": 4, "crop": crop, "scale": [0.5, 1.0],
                 "pad": True},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "schedule": {"total": {"steps": 2}},
    }


def test_the_loss_sums_valid_pixels_and_weighs_the_auxiliary_head():
    generator = torch.Generator().manual_seed(0)
    out, aux = torch.randn(2, 4, 5, 5, generator=generator), torch.randn(2, 4, 5, 5, generator=generator)
    target = torch.randint(0, 4, (2, 5, 5), generator=generator)
    target[0, :2] = 255
    loss = PixelLoss(255, aux_weight=0.4)
    valid = target != 255
    expected = sum(F.cross_entropy(logits.permute(0, 2, 3, 1)[valid], target[valid], reduction="sum") * weight
                   for logits, weight in ((out, 1.0), (aux, 0.4)))
    assert loss.count(target) == int(valid.sum()) == 40
    assert torch.allclose(loss({"out": out, "aux": aux}, target), expected)
    assert torch.allclose(PixelLoss(255)({"out": out, "aux": aux}, target), loss.pixels(out, target))


def test_all_pixels_is_mmsegmentations_default_mean_over_the_whole_window(voc):
    """data.loss_pixels: all, MMSegmentation's avg_non_ignore=False: the window's sum over every pixel of every crop
    (ignored ones as zeros), float64 on the logits against one pass's mean; the count is the crops' area, known
    without decoding a mask, and differs from the valid pixels."""
    recipe = parse_recipe({**recipe_for(voc, {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"},
                                        crop=16),
                           "data": {**recipe_for(voc, {})["data"], "crop": 16, "loss_pixels": "all"}})
    loss, data = build_loss(recipe), build_data(recipe)
    assert loss.all_pixels and data.info["loss_pixels"] == "all"
    indices = torch.arange(6)
    _, target = fetch_seeded(data.train, indices, seed=0, step=0)
    assert data.train.target_counts_at(0, 0, indices).tolist() == [16 * 16] * 6
    assert loss.count(target) == 6 * 16 * 16 > int((target != 255).sum())
    logits = torch.randn(6, 4, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                         requires_grad=True)
    window = sum(loss.count(target[i:i + 2]) for i in range(0, 6, 2))
    accumulated = sum(loss(logits[i:i + 2], target[i:i + 2]) / window for i in range(0, 6, 2))
    pixels = F.cross_entropy(logits, target, ignore_index=255, reduction="none")  # 0 where ignored
    (gradient,) = torch.autograd.grad(accumulated, logits)
    (reference,) = torch.autograd.grad(pixels.mean(), logits)
    assert torch.allclose(accumulated, pixels.mean(), rtol=1e-13, atol=0)
    assert torch.allclose(gradient, reference, rtol=1e-12, atol=1e-18)


def _gradients(model: torch.nn.Module, terms) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for term in terms:
        term().backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    difference = sum(float((x - y).norm()) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5
    return difference / sum(float(y.norm()) ** 2 for y in b) ** 0.5


def test_the_window_count_is_exact_and_a_mean_of_micro_batch_means_is_not(voc):
    """LR-ASPP MobileNetV3 (GroupNorm, so no layer mixes samples), float64: 3 micro-batches of 2 against one pass
    of 6. (The auxiliary head's term is normalised by the same count: the test above; FCN ResNet-50 here took 10 s.)"""
    recipe = parse_recipe(recipe_for(voc, {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"}, crop=16))
    data = build_data(recipe)
    loss = build_loss(recipe)
    assert isinstance(loss, PixelLoss)
    torch.manual_seed(0)
    model = build_model(recipe, data.info).double().eval()  # eval: no dropout (GroupNorm has no running stats)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    micro = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    batches = [fetch_seeded(data.train, i, seed=0, step=0) for i in micro]
    batches = [(x.double(), y) for x, y in batches]
    counts = [loss.count(y) for _, y in batches]
    assert len(set(counts)) == 3, counts  # different valid-pixel counts in each micro-batch
    window = sum(counts)
    whole_x, whole_y = (torch.cat(parts) for parts in zip(*batches, strict=True))

    reference = _gradients(model, [lambda: loss(model(whole_x), whole_y) / loss.count(whole_y)])
    plan = _gradients(model, [lambda x=x, y=y: loss(model(x), y) / window for x, y in batches])
    mmseg = _gradients(model, [lambda x=x, y=y: loss(model(x), y) / loss.count(y) / len(batches)
                               for x, y in batches])
    assert _relative(plan, reference) < 1e-12
    assert _relative(mmseg, reference) > 1e-3
    # the whole batch's mean as torch computes it, for the record: F.cross_entropy's default over the valid pixels
    output = model(whole_x)
    mean = F.cross_entropy(output["out"], whole_y, ignore_index=255)
    assert torch.allclose(mean, loss(output, whole_y) / window, rtol=1e-12, atol=0)


def test_verify_says_equivalent_with_unequal_valid_pixel_counts(voc, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_for(voc, {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"},
                                              crop=32, effective=8)))
    code, out, err = cli(capsys, "verify", path, "--micro-batch-max", "2", "--device", "cpu")
    assert code == 0, out + err
    assert "equivalent: global relative error" in out and "NOT" not in out
    line = next(line for line in out.splitlines() if "valid pixels (not ignore_index) per micro-batch" in line)
    counts = [int(n) for n in line.split("micro-batch: ")[1].split(";")[0].split(", ")]
    assert len(counts) == 4 and len(set(counts)) > 1 and f"the window's {sum(counts)}" in line


# slow (13 s): the window's pixel count is proven by
# test_the_window_count_is_exact_and_a_mean_of_micro_batch_means_is_not, a count all-reduced over ranks before the
# first backward by tests/e2e/test_distributed.py (tokens)
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.subprocess
def test_two_ranks_divide_by_the_valid_pixels_of_both(voc, tmp_path):
    """torchrun, 2 gloo processes x 2 x 2 against one process 2 x 4: each rank counts its own crops' valid pixels
    and the window's count is their sum (all-reduced before the first backward), so the weights agree and the
    logged count is the whole window's."""
    from helpers import assert_close_weights, reproduce_run, reproduce_run_here, weights
    from reproduce.observe.outputs import read_metrics
    from reproduce.plan.planner import make_plan
    from reproduce.train.windows import window

    recipe = recipe_for(voc, {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"}, crop=24, effective=8)
    recipe["evaluation"] = {"at_end": False}
    reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "2", "--nproc-per-node", "2")
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "2")
    assert_close_weights(weights(tmp_path, "two"), weights(tmp_path, "one"))
    spec = parse_recipe(recipe)
    data = build_data(spec)
    one = make_plan(spec, micro_batch_max=2, dataset_size=len(data.train))
    for record in read_metrics(tmp_path / "two" / "metrics.jsonl"):
        step = record["step"] - 1
        micro_batches, _ = window(one, len(data.train), step, spec.seed, 0, 2)
        masks = [fetch_seeded(data.train, indices, spec.seed, step)[1] for indices in micro_batches]
        assert record["world_size"] == 2 and record["items"] == sum(int((m != 255).sum()) for m in masks)
