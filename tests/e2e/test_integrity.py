"""Nothing silently different (issue 48, items 1-3), on a real run of the digits MLP:

1. a checkpoint or model.pt damaged anywhere (each zip structure: a record's bytes, its local header, its central
   directory entry, the end-of-archive record; the encrypted flag, the compression method, the directory attribute)
   is refused in one line before anything is loaded, never a traceback, never trained on;
2. a resumed run trains the plan its checkpoint was trained with: a plan.yaml edited (or a bit flipped that still
   parses) in a field that changes the computation is one line naming it, exit 2; an unknown decay kind is refused;
3. a finished run's end (model.pt, metrics.jsonl, loss.svg, summary.json) is checked against its last checkpoint, and
   `--resume` / `--auto-resume` write what is damaged again, byte for byte the uninterrupted run's.
"""

from __future__ import annotations

import io
import json
import random
import shutil
import struct
import typing
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

from helpers import SGD, cli, digits_recipe, snapshot
from reproduce.errors import UserError
from reproduce.storage import files
from reproduce.train.resume import read_torch_file

RECIPE = digits_recipe(SGD, steps=8, schedule={"warmup": {"steps": 2}, "decay": {"kind": "cosine", "min_lr": 0.001},
                                               "total": {"steps": 8}})
RUN = ("--device", "cpu", "--micro-batch-max", "16", "--checkpoint-every", "2")  # noise scale measured (N = 4)
END = ("model.pt", "metrics.jsonl", "loss.svg", "summary.json")


def run(capsys, source: Path, out: Path, *args: str) -> tuple[int, str, str]:
    return cli(capsys, "run", source, "--out", out, *RUN, *args)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The uninterrupted run: 8 steps, a checkpoint every 2, the noise scale measured."""
    from reproduce.cli import main

    tmp = tmp_path_factory.mktemp("finished")
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(tmp / "recipe.yaml"), "--out", str(tmp / "out"), *RUN])
    assert exit_info.value.code == 0
    return tmp / "out"


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    """The finished run copied into a folder of this test's, with the recipe it was run from beside it."""
    shutil.copy(finished.parent / "recipe.yaml", tmp_path / "recipe.yaml")
    return Path(shutil.copytree(finished, tmp_path / "out"))


# ---- 1. every byte a load reads is checked --------------------------------------------------------------------

def structures(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Where each zip structure of an archive lies, as (start, end) byte ranges: each record's local header and its
    bytes, each central directory entry, the end-of-archive record, and the seal (the zip comment)."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    found: dict[str, list[tuple[int, int]]] = {"local header": [], "record": [], "central directory": []}
    for info in archive.infolist():
        name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26: info.header_offset + 30])
        start = info.header_offset + 30 + name_length + extra_length
        found["local header"].append((info.header_offset, start))
        found["record"].append((start, start + info.file_size))
    position = archive.start_dir
    while data[position: position + 4] == b"PK\x01\x02":
        lengths = struct.unpack("<HHH", data[position + 28: position + 34])
        found["central directory"].append((position, position + 46 + sum(lengths)))
        position += 46 + sum(lengths)
    end = data.rfind(b"PK\x05\x06")
    comment = struct.unpack("<H", data[end + 20: end + 22])[0]
    found["end of archive"] = [(end, end + 22)]
    found["seal"] = [(end + 22, end + 22 + comment)] if comment else []
    return found


def flipped(data: bytes, position: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 1 << bit
    return bytes(damaged)


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def test_a_checkpoint_is_sealed_and_a_bit_flipped_in_any_zip_structure_is_found(finished, tmp_path):
    """Every header byte (a bit of each) and bytes of every record (the model, optimizer, RNG states and the kept
    metrics among them): the seal finds each change; a flip inside the seal itself is found or leaves the archive
    as it was (it then loads the same state)."""
    checkpoint = finished / "checkpoints" / "last.pt"
    data = checkpoint.read_bytes()
    assert data[-files.SEAL_LENGTH:].startswith(files.SEAL) and files.check_torch_file(checkpoint) is None
    state = torch.load(checkpoint, weights_only=True)
    assert {"rng_torch", "rng_python", "metrics", "model", "optimizer"} <= state.keys()
    where = structures(data)
    assert len(where["record"]) >= 10 and where["seal"]
    damaged = tmp_path / "last.pt"
    found = dict.fromkeys(where, 0)
    for name, ranges in where.items():
        for start, end in ranges:
            positions = range(start, end) if name != "record" else sorted({start, (start + end) // 2, end - 1})
            for position in positions:
                if end == start:
                    continue
                damaged.write_bytes(flipped(data, position, position % 8))
                problem = files.check_torch_file(damaged)
                if problem is None:
                    assert name == "seal" and same(torch.load(damaged, weights_only=True), state), (name, position)
                    continue
                assert problem.startswith("damaged"), problem
                found[name] += 1
    assert all(found[name] > 0 for name in where), found


CENTRAL_FLAGS, CENTRAL_METHOD, CENTRAL_ATTRIBUTES, LOCAL_FLAGS, LOCAL_METHOD = 8, 10, 38, 6, 8


def header_damage(data: bytes, how: str) -> bytes:
    """One of the header changes the CRC-32s miss, made to the archive's largest record."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    largest = max(archive.infolist(), key=lambda info: info.file_size)
    position = archive.start_dir
    while data[position + 46: position + 46 + len(largest.filename)] != largest.filename.encode():
        position += 46 + sum(struct.unpack("<HHH", data[position + 28: position + 34]))
    damaged = bytearray(data)
    if how == "encrypted flag":
        damaged[position + CENTRAL_FLAGS] |= 0x1
        damaged[largest.header_offset + LOCAL_FLAGS] |= 0x1
    elif how == "compression method deflate":
        damaged[position + CENTRAL_METHOD] = 8
        damaged[largest.header_offset + LOCAL_METHOD] = 8
    elif how == "compression method unknown":
        damaged[position + CENTRAL_METHOD] = 99
    elif how == "directory attribute":
        damaged[position + CENTRAL_ATTRIBUTES] |= 0x10
    else:  # the local header's name
        damaged[largest.header_offset + 30] ^= 0x1
    return bytes(damaged)


HEADER_DAMAGE = ["encrypted flag", "compression method deflate", "compression method unknown",
                 "directory attribute", "local name"]


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "unsealed (an older reproduce's, torch's own)"])
@pytest.mark.parametrize("how", HEADER_DAMAGE)
def test_header_damage_the_checksums_miss_is_one_line_before_any_load(how, sealed, finished, tmp_path):
    data = (finished / "checkpoints" / "last.pt").read_bytes()
    if not sealed:
        data = data[: -files.SEAL_LENGTH - 2] + b"\0\0"
    path = tmp_path / "last.pt"
    path.write_bytes(header_damage(data, how))
    assert (files.check_torch_file(path) or "").startswith("damaged"), how
    with pytest.raises(UserError) as error:
        read_torch_file(path, "`resume`")
    assert len(error.value.lines) == 1 and str(path) in error.value.lines[0]


def test_an_unsealed_checkpoint_damaged_in_its_headers_is_refused_or_loads_the_same(finished, tmp_path):
    """A checkpoint without the seal (written before it) is checked as its format allows: a flipped header bit is
    refused in one line (UserError), or loads exactly the state it held; never other tensors, never another error."""
    data = (finished / "checkpoints" / "last.pt").read_bytes()
    data = data[: -files.SEAL_LENGTH - 2] + b"\0\0"
    state = torch.load(io.BytesIO(data), weights_only=True)
    where = structures(data)
    headers = [p for name in ("local header", "central directory", "end of archive") for s, e in where[name]
               for p in range(s, e)]
    path, outcomes = tmp_path / "last.pt", {"refused": 0, "the same": 0}
    for position in random.Random(48).sample(headers, 300):
        path.write_bytes(flipped(data, position, random.Random(position).randrange(8)))
        try:
            loaded = read_torch_file(path, "`resume`")
        except UserError as error:
            assert len(error.lines) == 1
            outcomes["refused"] += 1
            continue
        assert same(loaded, state), position
        outcomes["the same"] += 1
    assert outcomes["refused"] > 50, outcomes


def record_of(data: bytes, tensor: torch.Tensor) -> tuple[int, int]:
    """Where the archive holds `tensor`'s bytes (one record's range)."""
    held = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    [where] = [(s, e) for s, e in structures(data)["record"] if data[s:e] == held]
    return where


@pytest.mark.parametrize("how", ["encrypted flag", "compression method deflate", "rng_torch", "metrics"])
def test_a_damaged_checkpoint_is_refused_by_resume_in_one_line_with_nothing_written(how, copy, capsys):
    checkpoint = copy / "checkpoints" / "last.pt"
    data = checkpoint.read_bytes()
    if how in ("rng_torch", "metrics"):  # a byte of the RNG state, of the kept metrics.jsonl: not only the weights
        start, end = record_of(data, torch.load(checkpoint, weights_only=True)[how])
        checkpoint.write_bytes(flipped(data, (start + end) // 2, 0))
    else:
        checkpoint.write_bytes(header_damage(data, how))
    (copy / "summary.json").unlink()  # (so the run has an end to write, were the checkpoint taken)
    before = snapshot(copy)
    code, _, err = run(capsys, copy / "plan.yaml", copy, "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --resume: {checkpoint} is damaged"), err
    assert snapshot(copy) == before


@pytest.mark.parametrize("how", ["encrypted flag", "directory attribute"])
def test_a_model_file_damaged_in_its_headers_is_refused_as_weights(how, finished, tmp_path, capsys):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    damaged = tmp_path / "model.pt"
    damaged.write_bytes(header_damage((finished / "model.pt").read_bytes(), how))
    code, _, err = run(capsys, tmp_path / "recipe.yaml", tmp_path / "out", "--weights", damaged, "--max-steps", "1")
    assert code == 2 and err.count("\n") == 1 and f"{damaged} is damaged" in err, err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_an_unsealed_checkpoint_still_resumes_bitwise(finished, tmp_path, capsys):
    """A checkpoint written before the seal (and before it kept the plan): it resumes, and the run ends as the
    uninterrupted one."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "out"
    assert run(capsys, tmp_path / "recipe.yaml", out, "--max-steps", "4")[0] == 0
    checkpoint = out / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=True)
    del state["extra"]["plan"], state["extra"]["summary"]
    torch.save(state, checkpoint)  # torch's own file: no seal
    assert not checkpoint.read_bytes()[-files.SEAL_LENGTH:].startswith(files.SEAL)
    code, _, err = run(capsys, out / "plan.yaml", out, "--resume")
    assert code == 0, err
    assert (out / "model.pt").read_bytes() == (finished / "model.pt").read_bytes()


# ---- 2. a resume trains its checkpoint's plan ------------------------------------------------------------------

def edit_plan(out: Path, path: str, value: object) -> None:
    plan = yaml.safe_load((out / "plan.yaml").read_text())
    node = plan
    *parents, last = path.split(".")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    (out / "plan.yaml").write_text(yaml.safe_dump(plan, sort_keys=False))


@pytest.fixture
def halfway(finished, tmp_path, capsys) -> Path:
    """The run stopped after step 4 (its checkpoint, its plan.yaml)."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE))
    out = tmp_path / "out"
    assert run(capsys, tmp_path / "recipe.yaml", out, "--max-steps", "4")[0] == 0
    return out


@pytest.mark.parametrize(("field", "value"), [
    ("schedule.min_lr", 0.01), ("segments.0.lr_factor", 2.0), ("recipe.optimizer.momentum", 0.5),
    ("recipe.model.kwargs.dropout", 0.1), ("schedule.decay_end_step", 6), ("steps_per_epoch", 3)])
def test_a_resume_with_a_plan_edited_in_a_computed_field_is_one_line_naming_it(field, value, halfway, capsys):
    edit_plan(halfway, field, value)
    before = snapshot(halfway)
    code, _, err = run(capsys, halfway / "plan.yaml", halfway, "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --resume: {halfway / 'plan.yaml'} differs from the plan "
                          f"{halfway / 'checkpoints' / 'last.pt'} was trained with: {field} ("), err
    assert snapshot(halfway) == before


def test_a_flipped_bit_in_plan_yaml_that_still_parses_is_refused(halfway, capsys):
    """`warmup_steps: 2` with bit 0 of the digit flipped reads `warmup_steps: 3`: a valid plan, another LR."""
    text = (halfway / "plan.yaml").read_bytes()
    at = text.index(b"  warmup_steps: 2\n") + len(b"  warmup_steps: ")
    (halfway / "plan.yaml").write_bytes(flipped(text, at, 0))
    assert b"warmup_steps: 3\n" in (halfway / "plan.yaml").read_bytes()
    code, _, err = run(capsys, halfway / "plan.yaml", halfway, "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert "schedule.warmup_steps (2 at the checkpoint, 3 now)" in err


def test_an_unknown_decay_kind_is_refused_not_run_as_polynomial(halfway, capsys):
    edit_plan(halfway, "schedule.decay_kind", "bosine")
    code, _, err = run(capsys, halfway / "plan.yaml", halfway, "--resume")
    assert code == 2 and err.count("\n") == 1, err
    assert "schedule.decay_kind" in err and "bosine" in err and "cosine" in err


def test_the_explicit_ways_still_resume(halfway, finished, capsys):
    """A smaller micro-batch (--micro-batch-max) changes the plan's split, not its computation: the resume runs."""
    code, _, err = run(capsys, halfway / "plan.yaml", halfway, "--resume", "--micro-batch-max", "8")
    assert code == 0, err
    assert [json.loads(line)["micro_batch"] for line in (halfway / "metrics.jsonl").read_text().splitlines()] == [
        16] * 4 + [8] * 4


def _plan_models() -> list[type]:
    """The pydantic models a plan file is made of, outside its recipe (validated as the recipe's own schema)."""
    from pydantic import BaseModel

    from reproduce.plan.planner import Plan
    from reproduce.plan.recipe import Recipe

    seen: list[type] = []

    def visit(model: type) -> None:
        if model in seen or model is Recipe:
            return
        seen.append(model)
        for info in model.model_fields.values():
            for kind in _types(info.annotation):
                if isinstance(kind, type) and issubclass(kind, BaseModel):
                    visit(kind)

    visit(Plan)
    return seen


def _types(annotation: object) -> list[object]:
    """The types an annotation holds values of (a dict's values, not its keys)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict:
        args = args[1:]
    return [annotation] + [t for arg in args for t in _types(arg)] if args else [annotation]


FREE_TEXT = {  # the plan's str fields that are words or paths, not one of a set of values
    "Plan.recipe_path", "Plan.batchnorm_warning", "Plan.warnings", "Plan.memory_notes", "Plan.data_fingerprint",
    "LrScaling.source", "AdamOption.source", "BatchNormPlan.found", "BatchNormPlan.lines", "BatchNormPlan.options",
    "ThroughputChoice.reason", "ThroughputChoice.device", "WeightsRecord.path", "WeightsRecord.fingerprint",
    "WeightsRecord.architecture", "WeightsRecord.differs",
}


def test_every_enumerated_plan_field_is_validated():
    """A plan field of a few values is a Literal (an unknown one is refused when the plan is read); every other str
    field of the plan is known to be free text. A new str field fails here until it is one or the other."""
    unchecked = []
    for model in _plan_models():
        for name, info in model.model_fields.items():
            if str in _types(info.annotation) and f"{model.__name__}.{name}" not in FREE_TEXT:
                unchecked.append(f"{model.__name__}.{name}")
    assert not unchecked, unchecked
    from reproduce.plan.schedules import DecayKind, StepSchedule

    decay = typing.get_args(typing.get_type_hints(StepSchedule)["decay_kind"])
    from reproduce.plan.recipe import Decay

    assert set(decay) == set(typing.get_args(DecayKind)) == set(
        typing.get_args(Decay.model_fields["kind"].annotation))


# ---- 3. a finished run is checked, not trusted ---------------------------------------------------------------

def damage(out: Path, name: str, how: str) -> None:
    path = out / name
    data = path.read_bytes()
    if how == "deleted":
        path.unlink()
    elif how == "cut":
        path.write_bytes(data[: len(data) // 2])
    elif how == "{}":
        path.write_text("{}\n")
    elif how == "garbled":
        path.write_bytes(header_damage(data, "encrypted flag") if name == "model.pt" else
                         data[:40] + b"\x00garbled\xff" + data[49:])
    elif how == "valid JSON, wrong content":  # summary.json: the right step, another final loss
        summary = json.loads(data)
        summary["final"]["loss"] = 0.5
        path.write_text(json.dumps(summary, indent=2) + "\n")
    elif how == "other weights":  # a whole, sealed model.pt of other weights
        state = torch.load(path, weights_only=True)
        first = next(iter(state))
        state[first] = state[first] + 1
        files.write_torch_file(path, lambda handle: torch.save(state, handle))
    else:  # "a line changed": metrics.jsonl still whole lines of JSON, one of them another loss
        lines = data.decode().splitlines(keepends=True)
        record = json.loads(lines[3])
        record["loss"] = 0.25
        path.write_text("".join([*lines[:3], json.dumps(record) + "\n", *lines[4:]]))


DAMAGES = [("model.pt", "deleted"), ("model.pt", "cut"), ("model.pt", "garbled"), ("model.pt", "other weights"),
           ("metrics.jsonl", "cut"), ("metrics.jsonl", "{}"), ("metrics.jsonl", "a line changed"),
           ("loss.svg", "cut"), ("loss.svg", "garbled"), ("loss.svg", "{}"),
           ("summary.json", "cut"), ("summary.json", "garbled"), ("summary.json", "{}"),
           ("summary.json", "valid JSON, wrong content")]


def the_end(out: Path, finished: Path) -> dict[str, bytes]:
    """The end's files of the uninterrupted run, as written in `out` (summary.json names the plot by its path)."""
    ends = {name: (finished / name).read_bytes() for name in END}
    ends["summary.json"] = ends["summary.json"].replace(str(finished).encode(), str(out).encode())
    return ends


@pytest.mark.parametrize(("name", "how"), DAMAGES, ids=[f"{n} {h}" for n, h in DAMAGES])
def test_resume_of_a_finished_run_writes_a_damaged_end_again_byte_for_byte(name, how, copy, finished, capsys):
    damage(copy, name, how)
    code, _, err = run(capsys, copy / "plan.yaml", copy, "--resume")
    assert code == 0, err
    assert "writing its end again" in err and "Traceback" not in err, err
    assert {n: (copy / n).read_bytes() for n in END} == the_end(copy, finished)
    assert json.loads((copy / "summary.json").read_text())["noise_scale"]["train_size"] is not None
    code, _, err = run(capsys, copy / "plan.yaml", copy, "--resume")  # whole now: nothing to do
    assert code == 2 and "nothing to do" in err, err


AUTO = [("summary.json", "{}"), ("summary.json", "garbled"), ("summary.json", "valid JSON, wrong content"),
        ("model.pt", "other weights"), ("loss.svg", "garbled"), ("metrics.jsonl", "cut")]


@pytest.mark.parametrize(("name", "how"), AUTO, ids=[f"{n} {h}" for n, h in AUTO])
def test_auto_resume_of_a_finished_run_writes_a_damaged_end_again(name, how, copy, finished, capsys):
    """--auto-resume (what --max-restarts and the SLURM script run) judges the run by its checkpoint: a damaged
    summary.json is no traceback, and no "finished" either."""
    damage(copy, name, how)
    code, out, err = run(capsys, copy.parent / "recipe.yaml", copy, "--auto-resume")
    assert code == 0, err
    assert "a finished run whose end is not whole" in out and "Traceback" not in err, out + err
    assert {n: (copy / n).read_bytes() for n in END} == the_end(copy, finished)
    code, out, err = run(capsys, copy.parent / "recipe.yaml", copy, "--auto-resume")
    assert code == 0 and "is finished (8 of 8 optimizer steps run); nothing to do" in out, out + err


def test_a_whole_finished_run_is_finished(copy, capsys):
    before = snapshot(copy)
    code, out, err = run(capsys, copy.parent / "recipe.yaml", copy, "--auto-resume")
    assert code == 0 and "nothing to do" in out, out + err
    code, _, err = run(capsys, copy / "plan.yaml", copy, "--resume")
    assert code == 2 and "nothing to do" in err and err.count("\n") == 1, err
    assert snapshot(copy) == before


# ---- 1. a sharded checkpoint's shard files ----------------------------------------------------------------------

@pytest.mark.slow  # two torchrun launches of 2 processes (~1 min here); the seal itself: the tests above
@pytest.mark.distributed
@pytest.mark.subprocess
def test_a_damaged_shard_file_of_a_sharded_checkpoint_is_refused_before_dcp_loads_it(tmp_path):
    """FSDP2 on 2 gloo processes: last.pt (sealed) keeps every shard file's SHA-256; a flipped byte in a shard is
    found before DCP loads it, naming the file; nothing of the run is written."""
    import subprocess
    import sys

    from helpers import ENV, MLP_CLIPPED

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(MLP_CLIPPED))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "reproduce", "run", str(recipe), "--out", str(out), "--device", "cpu",
               "--micro-batch-max", "16", "--nproc-per-node", "2", "--checkpoint-every", "2"]
    first = subprocess.run([*command, "--max-steps", "2"], capture_output=True, text=True, env=ENV, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    state = torch.load(out / "checkpoints" / "last.pt", weights_only=True)
    folder = out / "checkpoints" / state["sharded"]
    assert state["sharded_digests"] and set(state["sharded_digests"]) == {
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    shard = max((p for p in folder.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    shard.write_bytes(flipped(data, len(data) // 2, 3))
    before = snapshot(out)
    resumed = subprocess.run([*command, "--resume"], capture_output=True, text=True, env=ENV, timeout=300)
    assert resumed.returncode != 0
    assert f"{shard}: damaged or missing: it does not match the SHA-256 last.pt keeps of it" in resumed.stderr, (
        resumed.stderr[-3000:])
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".")} == {
        k: v for k, v in before.items() if not k.startswith(".")}
