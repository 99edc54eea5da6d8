"""Comments and docstrings in src/ that point at a file or folder of this project point at one that exists: a move
that leaves a pointer behind fails here. Three shapes are read: a path whose first folder is one of the project's
(`train/step.py`, `docs/schedules`, `reproduce/plan/recipe/data.py`), a bare module name (`recompute_check.py`), and a
folder named alone in parentheses (`(batchnorm/)`). Placeholders (`papers/NAME`, `DIR/train`) and files of other
projects (nanoGPT's `train.py`, listed below) are not pointers of this one."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "reproduce"
PROJECT_FOLDERS = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"} | {
    "docs", "bench", "tests", "papers", "reproduce", "src", "examples"}
# not paths of this project: other projects' (nanoGPT, Microsoft's LoRA) and the trackers' metric names
NOT_POINTERS = {"data/shakespeare_char", "data/DATASET/", "src/gpt2_encode.py", "train/loss", "train/lr"}
# files of the projects the comments cite (nanoGPT, BERT, MAE, Microsoft's LoRA, Alpaca-LoRA, cityscapesScripts, QLoRA,
# tensorflow_addons)
OTHER_PROJECTS_FILES = {"train.py", "model.py", "sample.py", "prepare.py", "run_pretraining.py", "models_mae.py",
                        "create_pretraining_data.py", "gpt2_encode.py", "export_hf_checkpoint.py",
                        "createTrainIdLabelImgs.py", "qlora.py", "lamb.py"}

PATH = re.compile(r"(?<![\w./-])((?:[a-z_][\w-]*/)+[A-Za-z_][\w-]*(?:\.py)?/?)")
MODULE = re.compile(r"(?<![\w./-])([a-z_]\w*\.py)\b")
FOLDER = re.compile(r"(?<![\w./-])([a-z_]\w*)/\)")  # `(batchnorm/)`, `torch: batchnorm/)`


def _comments(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(tok.start[0], tok.string) for tok in tokens
            if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.string.startswith(('"""', "'''")))]


def _exists(ref: str) -> bool:
    ref = ref.rstrip("/")
    return any((root / (ref + ext)).exists() for root in (SRC, SRC.parent, ROOT) for ext in ("", ".py", ".md", ".yaml"))


def _placeholder(ref: str) -> bool:
    return any(part.isupper() or len(part) == 1 for part in ref.rstrip("/").split("/"))


PROJECT_FILES = {p.name for folder in ("src", "tests", "bench") for p in (ROOT / folder).rglob("*.py")}
RUN_FOLDERS = {"adapter", "merged", "plots", "checkpoints", "tensorboard", "wandb", "mlflow"}  # what a run writes
PROJECT_DIRS = RUN_FOLDERS | {p.name for p in ROOT.rglob("*")
                               if p.is_dir() and not {".venv", ".git"} & set(p.parts)}


def stale_pointers(path: Path) -> list[str]:
    stale = []
    for line, text in _comments(path):
        for ref in PATH.findall(text):
            if (ref.split("/")[0] in PROJECT_FOLDERS and ref not in NOT_POINTERS and not _placeholder(ref)
                    and not _exists(ref)):
                stale.append(f"{line}: {ref}")
        stale += [f"{line}: {name}" for name in MODULE.findall(text)
                  if name not in PROJECT_FILES | OTHER_PROJECTS_FILES]
        stale += [f"{line}: {name}/)" for name in FOLDER.findall(text) if name not in PROJECT_DIRS]
    return stale


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_comments_point_at_files_that_exist(path):
    assert stale_pointers(path) == []


def test_a_stale_pointer_is_found(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""Built as train/no_such_module.py does (batchnorm/)."""\n'
                      "x = 1  # see recompute_check.py and plan/recipe/data.py\n"
                      "# as nanoGPT's train.py does, for papers/NAME (models/)\n")
    assert sorted(stale_pointers(module)) == ["1: batchnorm/)", "1: train/no_such_module.py", "2: recompute_check.py"]
