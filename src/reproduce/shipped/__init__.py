"""The recipes and check files shipped with reproduce, and a recipe given by name from any folder. No torch.

`papers` and `checks` here link to the repository's `papers/` and `reproduce/`, shipped as package data (every
`*.yaml`); a checkout without symlinks falls back to the top-level folders. A recipe argument is a file when one is
there, else a name (`goyal2017-resnet50`, with or without `.yaml` or `papers/`), looked for in the current folder
first (NAME.yaml, papers/NAME.yaml), then among the shipped; the commands say which file they read.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ..errors import UserError

HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parents[2]  # src/reproduce/shipped -> the repository's root, in a checkout
SUFFIXES = (".yaml", ".yml")


def _folder(packaged: str, top: str) -> Path | None:
    for folder in (HERE / packaged, CHECKOUT / top):
        if folder.is_dir() and any(p.suffix in SUFFIXES for p in folder.iterdir()):
            return folder
    return None


def papers_folder() -> Path | None:
    """The shipped recipes: the wheel's package data, else the checkout's papers/; None when neither is there."""
    return _folder("papers", "papers")


def checks_folder() -> Path | None:
    """The shipped check files (the project's own reproduction suite): package data, else the checkout's
    reproduce/ folder (its check files name their recipes as ../papers/NAME.yaml, which holds in both)."""
    folder = _folder("checks", "reproduce")
    return folder if folder is not None and (folder.parent / "papers").is_dir() else None


def recipe_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in SUFFIXES and p.is_file())


def shipped_recipes() -> dict[str, Path]:
    """{name: path} of every shipped recipe (the file name without .yaml)."""
    folder = papers_folder()
    return {p.stem: p for p in recipe_files(folder)} if folder is not None else {}


def is_shipped(path: str | Path) -> bool:
    """Whether `path` is one of the shipped recipe files (not a user's file of the same name)."""
    folder = papers_folder()
    return folder is not None and Path(path).resolve().parent == folder.resolve()


def resolve_recipe(given: str | Path, what: str = "recipe") -> Path:
    """The file `given` names: itself when it is a file (or a plan, or a folder: the reader says what it is), else
    the shipped recipe of that name. One UserError naming the closest shipped names otherwise."""
    path = Path(given)
    if path.exists():
        return path
    name: str | None = None  # the shipped recipe's name it may be: `NAME`, `NAME.yaml`, `papers/NAME.yaml`
    if not (path.is_absolute() or len(path.parts) > 2 or (len(path.parts) == 2 and path.parts[0] != "papers")):
        name = path.name
        for suffix in SUFFIXES:
            name = name.removesuffix(suffix)
        name = name or None
    if name is not None and len(path.parts) == 1:  # a bare name: the current folder's files first
        for local in [Path(f"{folder}{name}{suffix}") for folder in ("", "papers/") for suffix in SUFFIXES]:
            if local.is_file():
                return local
    recipes = shipped_recipes()
    if name is not None and name in recipes:
        return recipes[name]
    if name is None or not recipes:
        where = "" if recipes else " (and no shipped recipes were found with this installation)"
        raise UserError(f"{given}: no such {what} file{where}")
    close = [n for n in recipes if n.startswith(name)] or difflib.get_close_matches(name, list(recipes), n=3,
                                                                                     cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else "`reproduce papers` lists them"
    raise UserError(f"{given}: no such {what} file, and no shipped recipe of that name ({hint})")


def described(path: str | Path, given: str | Path) -> str:
    """Which file a command read, for its output: the path, and "shipped" when it is one of the shipped recipes."""
    return f"{path} (shipped with reproduce)" if is_shipped(path) else str(path)
