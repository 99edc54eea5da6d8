"""Data format `segmentation`: the VOC and images/ + masks/ layouts, joint transforms drawn per sample
from (seed, step, index), the valid-pixel counts from the masks alone, mIoU and pixel accuracy over the whole
split, and bad input (one line naming the file, exit 2, nothing written)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from helpers import cli, data_paths, snapshot
from reproduce.data import build_data
from reproduce.data.loader import MicroBatchStream, fetch_seeded
from reproduce.data.samples import write_voc
from reproduce.errors import UserError
from reproduce.plan.recipe import parse_recipe


@pytest.fixture(scope="module")
def voc(tmp_path_factory) -> Path:
    return Path(write_voc(tmp_path_factory.mktemp("scenes") / "voc", train=12, val=4)["path"])


def seg_recipe(path: Path | str, **data) -> dict:
    return {
        "batch": {"effective": 4},
        "task": "segmentation",
        "model": {"builtin": "lraspp-mobilenet-v3-large", "batchnorm": "group"},
        "data": {"format": "segmentation", "path": str(path), "classes": 4, "crop": 48, "scale": [0.5, 1.5],
                 "pad": True, **data},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "schedule": {"total": {"steps": 2}},
    }


def test_the_voc_layout_reads_its_lists_and_cuts_image_and_mask_together(voc):
    data = build_data(parse_recipe(seg_recipe(voc)))
    train, evaluation = data.train, data.eval
    assert (len(train), len(evaluation)) == (12, 4)
    assert data.info["layout"] == "voc" and data.info["classes"] == 4
    image, mask = fetch_seeded(train, torch.arange(4), seed=0, step=3)
    assert image.shape == (4, 3, 48, 48) and image.dtype == torch.float32
    assert mask.shape == (4, 48, 48) and mask.dtype == torch.int64
    assert set(mask.unique().tolist()) <= {0, 1, 2, 3, 255}
    # evaluation images at their own size, only normalised; the mask is the palette PNG's indices
    pair = evaluation.pairs[0]
    image, mask = evaluation[0]
    assert image.shape == (3, pair.height, pair.width)
    assert torch.equal(mask, torch.from_numpy(np.asarray(Image.open(pair.mask)).astype(np.int64)))


def test_the_draws_come_from_seed_step_and_index_alone(voc):
    train = build_data(parse_recipe(seg_recipe(voc))).train
    together = fetch_seeded(train, torch.tensor([0, 5, 7]), seed=1, step=4)
    apart = [fetch_seeded(train, torch.tensor([i]), seed=1, step=4) for i in (0, 5, 7)]
    assert torch.equal(together[0], torch.cat([a[0] for a in apart]))
    assert torch.equal(together[1], torch.cat([a[1] for a in apart]))
    other_step = fetch_seeded(train, torch.tensor([0, 5, 7]), seed=1, step=5)
    assert not torch.equal(together[1], other_step[1])
    # the run's loader with worker processes gives the same bits
    indices = [torch.tensor([0, 5, 7])]
    stream = MicroBatchStream(train, lambda step: indices, 4, 5, seed=1, workers=1, pin_memory=False)
    streamed = stream.take(4, indices[0])
    stream.close()
    assert torch.equal(streamed[0], together[0]) and torch.equal(streamed[1], together[1])


def test_the_valid_pixels_are_counted_from_the_masks_as_cut(voc):
    train = build_data(parse_recipe(seg_recipe(voc))).train
    indices = torch.arange(12)
    _, masks = fetch_seeded(train, indices, seed=2, step=9)
    counted = train.target_counts_at(2, 9, indices)
    assert counted.tolist() == (masks != 255).flatten(1).sum(1).tolist()
    assert len(set(counted.tolist())) > 1  # crops over padding and outlines: unequal counts
    assert (masks == 255).any()


def test_trainaug_reads_its_list_and_masks_folder_and_evaluates_on_segmentationclass(tmp_path, voc):
    """DeepLabV3's set-up: ImageSets/Segmentation/trainaug.txt with masks in SegmentationClassAug/ (data.split,
    data.masks); val still from SegmentationClass/. (write_voc writes the augmented set's folder and list too.)"""
    root = _copy(voc, tmp_path)
    ids = (root / "ImageSets" / "Segmentation" / "train.txt").read_text().split()[:5]
    (root / "ImageSets" / "Segmentation" / "trainaug.txt").write_text("\n".join(ids) + "\n")
    data = build_data(parse_recipe(seg_recipe(root, split="trainaug", masks="SegmentationClassAug")))
    assert len(data.train) == 5 and {p.mask.parent.name for p in data.train.pairs} == {"SegmentationClassAug"}
    assert {p.mask.parent.name for p in data.eval.pairs} == {"SegmentationClass"} and len(data.eval) == 4
    (root / "SegmentationClassAug" / f"{ids[2]}.png").unlink()
    with pytest.raises(UserError, match=f"no mask SegmentationClassAug/{ids[2]}.png"):
        build_data(parse_recipe(seg_recipe(root, split="trainaug", masks="SegmentationClassAug")))
    with pytest.raises(UserError, match="no mask folder Missing/"):
        build_data(parse_recipe(seg_recipe(root, layout="voc", masks="Missing")))


def test_the_images_masks_layout_pairs_by_name(tmp_path, voc):
    root = tmp_path / "plain"
    for sub in ("images/a", "masks/a"):
        (root / sub).mkdir(parents=True)
    names = sorted(p.stem for p in (voc / "JPEGImages").glob("*.jpg"))[:3]
    for name in names:
        shutil.copy(voc / "JPEGImages" / f"{name}.jpg", root / "images" / "a" / f"{name}.jpg")
        ids = np.asarray(Image.open(voc / "SegmentationClass" / f"{name}.png"))
        Image.fromarray(ids, mode="L").save(root / "masks" / "a" / f"{name}.png")  # label ids, greyscale
    data = build_data(parse_recipe(seg_recipe(root, eval_path=str(root))))
    assert data.info["layout"] == "images-masks" and len(data.train) == 3 and len(data.eval) == 3
    first = data.eval.pairs[0]
    assert torch.equal(data.eval[0][1], torch.from_numpy(np.asarray(Image.open(first.mask)).astype(np.int64)))


def test_miou_and_pixel_accuracy_over_the_whole_split():
    """torchmetrics' dataset-level mIoU (one confusion matrix over all batches, ignore_index excluded, classes
    absent from targets and predictions left out) against a confusion matrix counted here."""
    from types import SimpleNamespace

    from reproduce.train.evaluation import PixelMetrics

    plan_only = seg_recipe("/nowhere")
    plan_only["data"].update(available=False, path=None)
    recipe = parse_recipe(plan_only)
    metrics = PixelMetrics(SimpleNamespace(plan=SimpleNamespace(recipe=recipe), device=torch.device("cpu")))
    generator = torch.Generator().manual_seed(0)
    confusion = np.zeros((4, 4), dtype=np.int64)
    for _ in range(3):
        target = torch.randint(0, 3, (2, 8, 8), generator=generator)  # class 3 never in the targets
        target[:, 0] = 255
        logits = torch.randn(2, 4, 8, 8, generator=generator)
        logits[:, 3] -= 10  # ... nor predicted: it is left out of the mean
        metrics.update({"out": logits}, target)
        predicted = logits.argmax(1)
        valid = target != 255
        np.add.at(confusion, (target[valid].numpy(), predicted[valid].numpy()), 1)
    true_positive = np.diag(confusion)
    union = confusion.sum(0) + confusion.sum(1) - true_positive
    present = union > 0
    assert not present[3]
    result = metrics.compute()
    assert result["eval_miou"] == pytest.approx(float(np.mean(true_positive[present] / union[present])), abs=1e-6)
    assert result["eval_pixel_accuracy"] == pytest.approx(true_positive.sum() / confusion.sum(), abs=1e-6)
    # the per-class table: class 3 is n/a (None), the others their IoU; the mean is torchmetrics' macro Jaccard
    assert result["eval_class_iou"][3] is None
    assert result["eval_class_iou"][:3] == pytest.approx(list(true_positive[:3] / union[:3]), abs=1e-12)
    from torchmetrics.functional.classification import multiclass_jaccard_index

    generator = torch.Generator().manual_seed(0)
    targets, predictions = [], []
    for _ in range(3):
        target = torch.randint(0, 3, (2, 8, 8), generator=generator)
        target[:, 0] = 255
        logits = torch.randn(2, 4, 8, 8, generator=generator)
        logits[:, 3] -= 10
        targets.append(target)
        predictions.append(logits.argmax(1))
    theirs = multiclass_jaccard_index(torch.cat(predictions), torch.cat(targets), 4, average="macro", ignore_index=255)
    assert result["eval_miou"] == pytest.approx(float(theirs), abs=1e-6)


# ---- bad input: one line naming the file, exit 2, nothing written ---------------------------------------------------

def _copy(voc: Path, tmp_path: Path) -> Path:
    root = tmp_path / "voc"
    shutil.copytree(voc, root)
    return root


def _mask_size(root: Path) -> str:
    mask = root / "SegmentationClass" / "scene_00001.png"
    picture = Image.open(mask)
    smaller = picture.crop((0, 0, picture.width - 1, picture.height))
    smaller.save(mask)
    return f"{mask}: the mask is {picture.width - 1} x {picture.height}, its image"


def _mask_value(root: Path) -> str:
    mask = root / "SegmentationClass" / "scene_00002.png"
    picture = Image.open(mask)
    ids = np.asarray(picture).copy()
    ids[3, 3] = 7
    changed = Image.fromarray(ids, mode="P")
    changed.putpalette(picture.getpalette())
    changed.save(mask)
    return f"{mask}: mask value 7 is neither a class (data.classes 4: ids 0 .. 3) nor ignore_index 255"


def _no_mask(root: Path) -> str:
    (root / "SegmentationClass" / "scene_00003.png").unlink()
    return f"{root / 'JPEGImages' / 'scene_00003.jpg'}: no mask SegmentationClass/scene_00003.png"


def _no_image(root: Path) -> str:
    (root / "JPEGImages" / "scene_00004.jpg").unlink()
    listing = root / "ImageSets" / "Segmentation" / "train.txt"
    return f"{listing}: image id 'scene_00004' has no image JPEGImages/scene_00004.jpg (its mask"


def _empty_list(root: Path) -> str:
    listing = root / "ImageSets" / "Segmentation" / "train.txt"
    listing.write_text("\n")
    return f"{listing}: an empty list; expected the split's image ids, one a line"


def _crop_without_padding(root: Path) -> str:
    return "is smaller than data.crop 48 x 48 (width x height); state data.pad: true"


@pytest.mark.parametrize("breaks", [_mask_size, _mask_value, _no_mask, _no_image, _empty_list,
                                    _crop_without_padding])
def test_bad_segmentation_data_is_one_line_exit_2_nothing_written(breaks, voc, tmp_path, capsys):
    root = _copy(voc, tmp_path)
    expected = breaks(root)
    recipe = seg_recipe(root, pad=None) if breaks is _crop_without_padding else seg_recipe(root)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", path, "--out", tmp_path / "out", "--device", "cpu", "--micro-batch-max", "2")
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_mask_without_an_image_in_images_masks(tmp_path, voc):
    root = tmp_path / "plain"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    shutil.copy(voc / "JPEGImages" / "scene_00000.jpg", root / "images" / "x.jpg")
    shutil.copy(voc / "SegmentationClass" / "scene_00000.png", root / "masks" / "x.png")
    shutil.copy(voc / "SegmentationClass" / "scene_00001.png", root / "masks" / "y.png")
    with pytest.raises(UserError) as caught:
        build_data(parse_recipe(seg_recipe(root)))
    assert caught.value.lines == [f"{root / 'masks' / 'y.png'}: a mask without an image (expected "
                                  f"{root / 'images' / 'y'}.jpg or .png)"]
    (root / "masks" / "y.png").unlink()
    (root / "masks" / "x.png").unlink()
    with pytest.raises(UserError) as caught:
        build_data(parse_recipe(seg_recipe(root)))
    assert caught.value.lines == [f"{root / 'images' / 'x.jpg'}: no mask {root / 'masks' / 'x.png'}"]


def test_samples_writes_a_voc_folder(tmp_path):
    from reproduce.data.samples import main

    assert main(["segmentation", str(tmp_path / "scenes")]) == 0
    lists = tmp_path / "scenes" / "ImageSets" / "Segmentation"
    assert len((lists / "train.txt").read_text().split()) == 160 and len((lists / "val.txt").read_text().split()) == 40
    mask = Image.open(tmp_path / "scenes" / "SegmentationClass" / "scene_00000.png")
    assert mask.mode == "P" and 255 in np.unique(np.asarray(mask))
    # the augmented set DeepLabV3's recipe reads (split: trainaug, masks: SegmentationClassAug): the training scenes,
    # their labels as greyscale PNGs
    assert (lists / "trainaug.txt").read_text() == (lists / "train.txt").read_text()
    augmented = Image.open(tmp_path / "scenes" / "SegmentationClassAug" / "scene_00000.png")
    assert augmented.mode == "L" and np.array_equal(np.asarray(augmented), np.asarray(mask))
    assert len(list((tmp_path / "scenes" / "SegmentationClassAug").glob("*.png"))) == 160
    deeplab = yaml.safe_load((Path(__file__).parents[3] / "papers" / "chen2017-deeplabv3.yaml").read_text())
    data = build_data(data_paths(parse_recipe(deeplab), str(tmp_path / "scenes"), None))  # --data PATH
    assert len(data.train) == 160 and {p.mask.parent.name for p in data.train.pairs} == {"SegmentationClassAug"}


def test_a_run_counts_the_pixels_it_trains_on_and_resumes_bitwise_with_workers(voc, tmp_path):
    """LR-ASPP (GroupNorm) on the scenes: a run stopped after 2 of 4 steps and resumed with a worker process gives
    bitwise the weights of an uninterrupted run without workers; each step's `items` is its window's valid pixels
    as the loader cut them."""
    from helpers import assert_same_model
    from reproduce.observe.outputs import read_metrics
    from reproduce.plan.planner import make_plan
    from reproduce.train.trainer import RunRequest, train
    from reproduce.train.windows import window

    recipe = seg_recipe(voc, crop=32)
    recipe["schedule"]["total"]["steps"] = 4
    recipe["evaluation"] = {"at_end": False}
    spec = parse_recipe(recipe)
    data = build_data(spec)
    plan = make_plan(spec, micro_batch_max=2, dataset_size=len(data.train))
    train(plan, RunRequest(tmp_path / "full", device="cpu", workers=0), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", max_steps=2, workers=1), data=data)
    train(plan, RunRequest(tmp_path / "split", device="cpu", resume=True, workers=1), data=data)
    assert_same_model(tmp_path / "full", tmp_path / "split")
    records = read_metrics(tmp_path / "full" / "metrics.jsonl")
    for record in records:
        if "items" not in record:
            continue
        step = record["step"] - 1
        micro_batches, _ = window(plan, len(data.train), step, spec.seed, 0, 2)
        masks = [fetch_seeded(data.train, indices, spec.seed, step)[1] for indices in micro_batches]
        assert record["items"] == sum(int((m != 255).sum()) for m in masks)
    assert sum("items" in r for r in records) == 4


# ---- the layouts people have their data in: Cityscapes, MMSegmentation's ----------------------------------------

def _cityscapes(voc: Path, root: Path, raw_only: bool = False) -> Path:
    """The scenes as Cityscapes lays them out: leftImg8bit/SPLIT/CITY/*_leftImg8bit.png, gtFine/SPLIT/CITY/
    *_gtFine_labelTrainIds.png (or only *_gtFine_labelIds.png, before createTrainIdLabelImgs.py)."""
    lists = voc / "ImageSets" / "Segmentation"
    for split in ("train", "val"):
        for index, name in enumerate((lists / f"{split}.txt").read_text().split()):
            city = ("aachen", "bremen")[index % 2]
            stem = f"{city}_{index:06d}_000019"
            images, masks = root / "leftImg8bit" / split / city, root / "gtFine" / split / city
            images.mkdir(parents=True, exist_ok=True)
            masks.mkdir(parents=True, exist_ok=True)
            Image.open(voc / "JPEGImages" / f"{name}.jpg").save(images / f"{stem}_leftImg8bit.png")
            ids = np.asarray(Image.open(voc / "SegmentationClass" / f"{name}.png"))
            kind = "labelIds" if raw_only else "labelTrainIds"
            Image.fromarray(ids).save(masks / f"{stem}_gtFine_{kind}.png")
    return root


def test_the_cityscapes_layout_reads_its_train_and_val_splits(voc, tmp_path):
    root = _cityscapes(voc, tmp_path / "cityscapes")
    data = build_data(parse_recipe(seg_recipe(root)))
    assert data.info["layout"] == "cityscapes" and (len(data.train), len(data.eval)) == (12, 4)
    for pair in data.train.pairs + data.eval.pairs:  # each image with its city's labelTrainIds mask
        assert pair.mask == root / "gtFine" / pair.image.relative_to(root / "leftImg8bit").parent / (
            pair.image.name.replace("_leftImg8bit.png", "_gtFine_labelTrainIds.png"))
    assert {p.image.parts[-3] for p in data.eval.pairs} == {"val"}


def test_cityscapes_with_labelids_only_names_the_script(voc, tmp_path, capsys):
    root = _cityscapes(voc, tmp_path / "cityscapes", raw_only=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(seg_recipe(root)))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", path, "--out", tmp_path / "out", "--device", "cpu", "--micro-batch-max", "2")
    assert code == 2 and "Traceback" not in err
    raw = root / "gtFine" / "train" / "aachen" / "aachen_000000_000019_gtFine_labelIds.png"
    assert err.strip().splitlines() == [
        f"error: {raw}: Cityscapes' labelIds (34 raw ids) without its gtFine_labelTrainIds.png (the 19 training "
        f"classes, 255 void); make them with cityscapesscripts' createTrainIdLabelImgs.py (pip install "
        f"cityscapesscripts; CITYSCAPES_DATASET={root} python -m cityscapesscripts.preparation."
        "createTrainIdLabelImgs)"]
    assert snapshot(tmp_path) == before


def test_images_and_masks_with_train_and_val_folders_are_the_splits(voc, tmp_path):
    root = tmp_path / "plain"
    lists = voc / "ImageSets" / "Segmentation"
    for split in ("train", "val"):
        for top in ("images", "masks"):
            (root / top / split).mkdir(parents=True)
        for name in (lists / f"{split}.txt").read_text().split():
            shutil.copy(voc / "JPEGImages" / f"{name}.jpg", root / "images" / split / f"{name}.jpg")
            shutil.copy(voc / "SegmentationClass" / f"{name}.png", root / "masks" / split / f"{name}.png")
    data = build_data(parse_recipe(seg_recipe(root)))
    assert data.info["layout"] == "images-masks" and (len(data.train), len(data.eval)) == (12, 4)
    assert {p.image.parent.name for p in data.eval.pairs} == {"val"}
    # a JPEG mask where the PNG is expected is named
    name = (lists / "val.txt").read_text().split()[0]
    (root / "masks" / "val" / f"{name}.png").unlink()
    Image.open(voc / "JPEGImages" / f"{name}.jpg").convert("L").save(root / "masks" / "val" / f"{name}.jpg")
    with pytest.raises(UserError) as caught:
        build_data(parse_recipe(seg_recipe(root)))
    assert caught.value.lines == [
        f"{root / 'images' / 'val' / name}.jpg: no mask {root / 'masks' / 'val' / name}.png; {name}.jpg is a JPG "
        "file, and a mask is a PNG of class ids (JPEG's lossy compression changes the ids along every edge): save "
        "the masks as PNG"]


def test_a_run_without_evaluation_data_says_so(voc, tmp_path):
    from reproduce.plan.planner import make_plan
    from reproduce.train.setup import build

    root = tmp_path / "train-only"
    shutil.copytree(voc, root)
    (root / "ImageSets" / "Segmentation" / "val.txt").unlink()
    spec = parse_recipe(seg_recipe(root))
    data = build_data(spec)
    assert data.eval is None
    setup = build(make_plan(spec, micro_batch_max=2, dataset_size=len(data.train)), torch.device("cpu"), data=data)
    assert setup.notes[-1].startswith("no evaluation data: the run reports no eval loss, mIoU or pixel accuracy")
