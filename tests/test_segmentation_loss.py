"""Task segmentation's loss (issue 31): per-pixel cross-entropy over the pixels not at ignore_index, the window's sum
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
from reproduce.data.shape_scenes import write_voc
from reproduce.models import build_model
from reproduce.recipe import parse_recipe
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
    model = build_model(recipe, data["info"]).double().eval()  # eval: no dropout (GroupNorm has no running stats)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    micro = [torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([4, 5])]
    batches = [fetch_seeded(data["train"], i, seed=0, step=0) for i in micro]
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
