"""Real data in the on-disk formats, made on this machine from what it has (nothing is downloaded).

    python -m reproduce.data.samples KIND DIR [--max-bytes N] [--image-size S] [--limit N]

KIND: `images` (the digits split as PNGs in class folders), `tokenizer` (a byte-level BPE trained on the standard
library's sources), `tokens` (those sources as uint16 ids, nanoGPT's train.bin / val.bin), `instructions` (Alpaca
records from the standard library's docstrings, JSONL), `hf-datasets` (those records with save_to_disk, the digits
as parquet), `segmentation` (shapes in Pascal VOC's layout), `models` (tiny-llama and tiny-gpt2, `save_pretrained`
folders of random weights with the tokenizer, alpaca.json and guanaco.jsonl, for docs/own-weights.md), or `all` (each in
DIR/<kind>, one tokenizer). Every tenth file or record is the validation split. Tests, the benchmark and `make demo`
build their data with these.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

from .builtin import digits_split, stdlib_sources

EOS = "<|endoftext|>"
VOCAB_SIZE = 512
MAX_BYTES = 400_000
VALIDATION_EVERY = 10
MIN_RESPONSE_CHARACTERS = 20


def _digits_split() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    bunch, train, val = digits_split()
    return {split: (bunch.images[idx], bunch.target[idx]) for split, idx in (("train", train), ("val", val))}


def _png(image: np.ndarray, size: int) -> bytes:
    from PIL import Image

    picture = Image.fromarray(np.round(image * 255 / 16).astype(np.uint8), mode="L")
    if size != picture.width:
        picture = picture.resize((size, size), Image.Resampling.BILINEAR)
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def write_images(folder: Path, image_size: int = 8) -> dict:
    counts = {}
    for split, (images, labels) in _digits_split().items():
        for number, (image, label) in enumerate(zip(images, labels, strict=True)):
            target = folder / split / str(label) / f"{number:04d}.png"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(_png(image, image_size))
        counts[split] = len(labels)
    return {"train": str(folder / "train"), "val": str(folder / "val"), "images": counts, "classes": 10}


def _source_texts(max_bytes: int) -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in stdlib_sources(max_bytes)]


def train_tokenizer(folder: Path, vocab_size: int = VOCAB_SIZE, max_bytes: int = MAX_BYTES) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_source_texts(max_bytes), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    folder.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(folder))
    return {"tokenizer": str(folder), "vocab_size": len(wrapped)}


def _tokenizer_for(folder: Path, tokenizer: Path | None, max_bytes: int) -> dict:
    if tokenizer is not None:
        return {"tokenizer": str(tokenizer)}
    return train_tokenizer(folder / "tokenizer", max_bytes=max_bytes)


def write_tokens(folder: Path, max_bytes: int = MAX_BYTES, tokenizer: Path | None = None) -> dict:
    from transformers import AutoTokenizer

    made = _tokenizer_for(folder, tokenizer, max_bytes)
    tokenizer = AutoTokenizer.from_pretrained(made["tokenizer"], local_files_only=True)
    made["vocab_size"] = len(tokenizer)
    splits: dict[str, list[int]] = {"train": [], "val": []}
    for index, text in enumerate(_source_texts(max_bytes)):
        split = "val" if index % VALIDATION_EVERY == VALIDATION_EVERY - 1 else "train"
        splits[split] += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, ids in splits.items():
        np.asarray(ids, dtype=np.uint16).tofile(folder / f"{split}.bin")
        counts[split] = len(ids)
    return {"train": str(folder / "train.bin"), "val": str(folder / "val.bin"), "tokens": counts, **made}


def docstring_records(limit: int = 2000) -> list[dict]:
    """Alpaca records explaining the standard library's documented functions and classes by their docstrings."""
    records = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        if path.stem.startswith("_"):  # private and test-only modules
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            docstring = ast.get_docstring(node)
            output = inspect.cleandoc(docstring).split("\n\n")[0].strip()[:400] if docstring else ""
            if len(output) < MIN_RESPONSE_CHARACTERS:
                continue
            kind = "function" if isinstance(node, ast.FunctionDef) else "class"
            signature = f"def {node.name}({ast.unparse(node.args)})" if kind == "function" else ""
            records.append({
                "instruction": f"Explain what the {kind} {node.name} in Python's {path.stem} module does.",
                "input": signature,
                "output": output,
            })
            if len(records) >= limit:
                return records
    return records


def _split_records(records: list[dict]) -> dict[str, list[dict]]:
    val = [r for i, r in enumerate(records) if i % VALIDATION_EVERY == VALIDATION_EVERY - 1]
    train = [r for i, r in enumerate(records) if i % VALIDATION_EVERY != VALIDATION_EVERY - 1]
    return {"train": train, "val": val}


def write_instructions(folder: Path, limit: int = 2000, max_bytes: int = MAX_BYTES, tokenizer: Path | None = None
                       ) -> dict:
    made = _tokenizer_for(folder, tokenizer, max_bytes)
    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, rows in _split_records(docstring_records(limit)).items():
        with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row) + "\n" for row in rows)
        counts[split] = len(rows)
    return {"train": str(folder / "train.jsonl"), "val": str(folder / "val.jsonl"), "records": counts, **made}


def write_hf_datasets(folder: Path, limit: int = 2000) -> dict:
    import datasets

    datasets.disable_progress_bars()
    splits = _split_records(docstring_records(limit))
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list(splits["train"]),
                                  "validation": datasets.Dataset.from_list(splits["val"])})
    folder.mkdir(parents=True, exist_ok=True)
    saved.save_to_disk(str(folder / "instructions"))
    import pyarrow as pa
    import pyarrow.parquet as pq

    for split, (images, labels) in _digits_split().items():
        table = pa.table({
            "pixels": [list((image / 16.0).astype(np.float32).ravel()) for image in images],
            "image": [{"bytes": _png(image, 8), "path": None} for image in images],
            "label": [int(label) for label in labels],
        })
        pq.write_table(table, folder / f"digits-{split}.parquet")
    return {"instructions": str(folder / "instructions"), "digits": str(folder / "digits-train.parquet"),
            "records": {split: len(rows) for split, rows in splits.items()}}


# ---- segmentation scenes -----------------------------------------------------------------------------------------
# 1-3 shapes on a smooth background, outlines 255 (ignored) as in VOC's masks, sizes varied to exercise crops and pads

CLASSES = ("background", "disc", "square", "triangle")
CLASS_COLOURS = {1: (200, 60, 60), 2: (60, 190, 70), 3: (60, 80, 210)}  # RGB, jittered per shape
IGNORE = 255
BORDER = 1  # outline pixels marked IGNORE on each side of a shape's edge
MIN_SIDE, MAX_SIDE = 64, 88


def voc_palette() -> list[int]:
    """Pascal VOC's colour map (the class id's bits interleaved); 255 is VOC's border colour."""
    palette = []
    for index in range(256):
        colour = [0, 0, 0]
        for bit in range(8):
            for channel in range(3):
                colour[channel] |= ((index >> (3 * bit + channel)) & 1) << (7 - bit)
        palette += colour
    palette[IGNORE * 3:IGNORE * 3 + 3] = [224, 224, 192]
    return palette


def _shape(kind: int, ys: np.ndarray, xs: np.ndarray, cy: float, cx: float, radius: float) -> np.ndarray:
    if kind == 1:
        return (ys - cy) ** 2 + (xs - cx) ** 2 <= radius**2
    if kind == 2:
        return (np.abs(ys - cy) <= radius * 0.85) & (np.abs(xs - cx) <= radius * 0.85)
    # an upward triangle: below its apex, above its base, within the two slanted edges
    top, base = cy - radius, cy + radius * 0.8
    half = (ys - top) / (base - top) * radius
    return (ys >= top) & (ys <= base) & (np.abs(xs - cx) <= half)


def _edge(region: np.ndarray) -> np.ndarray:
    """Pixels within BORDER of the region's boundary, on either side."""
    grown, shrunk = region.copy(), region.copy()
    for _ in range(BORDER):
        padded = np.pad(grown, 1)
        grown = padded[1:-1, 1:-1] | padded[:-2, 1:-1] | padded[2:, 1:-1] | padded[1:-1, :-2] | padded[1:-1, 2:]
        padded = np.pad(shrunk, 1, constant_values=True)
        shrunk = padded[1:-1, 1:-1] & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return grown & ~shrunk


def scene(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(image uint8 H x W x 3, mask uint8 H x W) of one scene."""
    height, width = (int(v) for v in rng.integers(MIN_SIDE, MAX_SIDE + 1, size=2))
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float64)
    # a bilinear gradient of low-saturation colours, with noise
    corners = rng.uniform(60, 200, size=(2, 2, 1)) + rng.uniform(-15, 15, size=(2, 2, 3))
    fy, fx = (ys / height)[..., None], (xs / width)[..., None]
    image = ((1 - fy) * ((1 - fx) * corners[0, 0] + fx * corners[0, 1]) + fy * ((1 - fx) * corners[1, 0]
             + fx * corners[1, 1]))
    image += rng.normal(0, 12, size=image.shape)
    mask = np.zeros((height, width), dtype=np.uint8)
    edges = np.zeros((height, width), dtype=bool)
    for _ in range(int(rng.integers(1, 4))):
        kind = int(rng.integers(1, len(CLASSES)))
        radius = rng.uniform(6, min(height, width) / 3)
        cy, cx = rng.uniform(radius, height - radius), rng.uniform(radius, width - radius)
        region = _shape(kind, ys, xs, cy, cx, radius)
        colour = np.array(CLASS_COLOURS[kind]) + rng.uniform(-40, 40, size=3)
        image[region] = colour + rng.normal(0, 12, size=(int(region.sum()), 3))
        mask[region] = kind
        edges |= _edge(region)
    mask[edges] = IGNORE
    return np.clip(image, 0, 255).astype(np.uint8), mask


def write_voc(folder: Path, train: int = 160, val: int = 40, seed: int = 0) -> dict:
    """`train` + `val` scenes as a VOC folder, the training scenes as the augmented set too (trainaug.txt)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for sub in ("JPEGImages", "SegmentationClass", "SegmentationClassAug", "ImageSets/Segmentation"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    palette = voc_palette()
    names = {"train": [f"scene_{i:05d}" for i in range(train)],
             "val": [f"scene_{i:05d}" for i in range(train, train + val)]}
    for split, ids in names.items():
        for name in ids:
            image, mask = scene(rng)
            Image.fromarray(image, mode="RGB").save(folder / "JPEGImages" / f"{name}.jpg", quality=95)
            picture = Image.fromarray(mask, mode="P")
            picture.putpalette(palette)
            picture.save(folder / "SegmentationClass" / f"{name}.png")
            if split == "train":
                Image.fromarray(mask, mode="L").save(folder / "SegmentationClassAug" / f"{name}.png")
        (folder / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{n}\n" for n in ids))
    (folder / "ImageSets" / "Segmentation" / "trainaug.txt").write_text("".join(f"{n}\n" for n in names["train"]))
    return {"path": str(folder), "layout": "voc", "classes": len(CLASSES), "train": train, "val": val,
            "ignore_index": IGNORE}


# ---- pretrained-model folders to try `--weights` on ---------------------------------------------------------------

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 4, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
GPT2 = {"n_positions": 512, "n_embd": 32, "n_layer": 2, "n_head": 2}
# kind -> transformers' model and config classes, the configuration, save_pretrained's options (GPT-2: in shards)
MODEL_KINDS = {"Llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA, {}),
               "GPT2": ("GPT2LMHeadModel", "GPT2Config", GPT2, {"max_shard_size": "100KB"})}


def write_model(kind: str, folder: Path, tokenizer: Path, seed: int = 0, **config) -> dict:
    """transformers' `kind` model (Llama or GPT2: seeded random weights; GPT-2's in 100KB shards) saved with
    save_pretrained, `tokenizer` beside it."""
    import torch
    import transformers
    from transformers.utils import logging

    from .text import load_tokenizer

    loaded = load_tokenizer(str(tokenizer))
    torch.manual_seed(seed)
    model_class, config_class, defaults, saving = MODEL_KINDS[kind]
    settings = {**defaults, "vocab_size": len(loaded), "eos_token_id": loaded.eos_token_id,
                "bos_token_id": loaded.eos_token_id, **config}
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**settings))
    logging.disable_progress_bar()
    model.save_pretrained(str(folder), **saving)
    transformers.AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True).save_pretrained(str(folder))
    return {"folder": str(folder), "parameters": sum(p.numel() for p in model.parameters())}


def write_alpaca_json(path: Path, limit: int = 200) -> dict:
    records = docstring_records(limit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=1) + "\n", encoding="utf-8")
    return {"path": str(path), "records": len(records)}


def write_models(folder: Path, limit: int = 200, max_bytes: int = MAX_BYTES, tokenizer: Path | None = None) -> dict:
    made = _tokenizer_for(folder, tokenizer, max_bytes)
    made["tiny-llama"] = write_model("Llama", folder / "tiny-llama", Path(made["tokenizer"]))
    made["tiny-gpt2"] = write_model("GPT2", folder / "tiny-gpt2", Path(made["tokenizer"]))
    made["alpaca.json"] = write_alpaca_json(folder / "alpaca.json", limit)
    records = docstring_records(40)  # openassistant-guanaco's layout
    lines = [json.dumps({"text": f"### Human: {r['instruction']}### Assistant: {r['output'][:200]}"}) for r in records]
    (folder / "guanaco.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    made["guanaco.jsonl"] = {"path": str(folder / "guanaco.jsonl"), "records": len(lines)}
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reproduce.data.samples", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=["images", "tokenizer", "tokens", "instructions", "hf-datasets", "segmentation",
                                         "models", "all"])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="standard-library source bytes to use")
    parser.add_argument("--image-size", type=int, default=8, help="side of the digit images in pixels")
    parser.add_argument("--limit", type=int, default=2000, help="most docstring records")
    args = parser.parse_args(argv)
    shared = args.folder / "tokenizer" if args.kind == "all" else None  # `all`: one tokenizer for both
    makers = {
        "images": lambda folder: write_images(folder, args.image_size),
        "tokenizer": lambda folder: train_tokenizer(folder, max_bytes=args.max_bytes),
        "tokens": lambda folder: write_tokens(folder, args.max_bytes, shared),
        "instructions": lambda folder: write_instructions(folder, args.limit, args.max_bytes, shared),
        "hf-datasets": lambda folder: write_hf_datasets(folder, args.limit),
        "segmentation": write_voc,
        "models": lambda folder: write_models(folder, args.limit, args.max_bytes, shared),
    }
    kinds = list(makers) if args.kind == "all" else [args.kind]
    for kind in kinds:
        folder = args.folder / kind if args.kind == "all" else args.folder
        print(f"{kind}: {json.dumps(makers[kind](folder))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
