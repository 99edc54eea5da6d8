"""A run folder whose plan.yaml is `reproduce-plan/1` (written before the plan was made of its parts) resumes as the
same run: tests/data/plan-v1-digits.yaml is the plan.yaml that `reproduce run papers/digits-mlp.yaml
--micro-batch-max 16` wrote at a1e9f2b."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from core_helpers import cli
from reproduce.plan.planfile import load_plan

V1_PLAN = Path(__file__).resolve().parents[1] / "data" / "plan-v1-digits.yaml"
TIMINGS = {"seconds", "data_seconds", "samples_per_second", "flops_per_second", "mfu", "peak_memory_bytes"}


def metrics(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [{key: value for key, value in json.loads(line).items() if key not in TIMINGS} for line in lines]


def test_a_run_folder_with_a_v1_plan_resumes_as_the_same_run(tmp_path, capsys, one_thread):
    new = tmp_path / "new"
    args = ["--out", new, "--device", "cpu", "--no-noise-scale", "--set", "gates=[]"]  # (v1 predates the gates)
    code, _, err = cli(capsys, "run", "papers/digits-mlp.yaml", "--micro-batch-max", "16", *args, "--max-steps", "2")
    assert code == 0, err
    old = tmp_path / "old"
    shutil.copytree(new, old)
    shutil.copy(V1_PLAN, old / "plan.yaml")  # the folder as the code before reproduce-plan/2 left it
    for folder in (new, old):
        code, _, err = cli(capsys, "run", folder / "plan.yaml", "--out", folder, "--device", "cpu", "--no-noise-scale",
                           "--resume", "--max-steps", "4")
        assert code == 0, err
    assert len(metrics(old)) == 4 and metrics(old) == metrics(new)
    assert (old / "model.pt").read_bytes() == (new / "model.pt").read_bytes()
    # the resumed run writes its plan again, now as reproduce-plan/2: the same plan as the other folder's
    assert yaml.safe_load((old / "plan.yaml").read_text(encoding="utf-8"))["format"] == "reproduce-plan/2"
    assert load_plan(old / "plan.yaml") == load_plan(new / "plan.yaml")
