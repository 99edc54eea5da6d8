"""A fingerprint of what the commands print and write, for a refactor that must not change them: `plan --json` of
every shipped recipe (with each option that changes a recipe: sharding, quantised base, memory techniques,
BatchNorm, packing, weights, data paths, `--set`), the same options' bad-input lines, and three short runs' metrics
(timings left out) and weights. Run it on both versions and diff the JSON files (bench/plan_fingerprint.py does the
planner's arithmetic over many sizes).

    PYTHONPATH=src python bench/cli_fingerprint.py /tmp/cli-before.json      # about 3 minutes here
"""
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"(second|seconds|_per_|time|elapsed|eta|wait|share|mfu|flops)", re.I)


def cli(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "reproduce", *args], capture_output=True, text=True, cwd=ROOT)
    return done.returncode, done.stdout + "\n--stderr--\n" + done.stderr


def metrics(folder: Path) -> list:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not TIMING.search(k)} for row in rows]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else "absent"


out: dict[str, object] = {}
recipes = sorted(p.stem for p in (ROOT / "papers").glob("*.yaml"))
for name in recipes:
    for extra in ([], ["--world-size", "8"], ["--policy", "fast", "--world-size", "3"]):
        out[f"plan {name} {' '.join(extra)}"] = cli("plan", name, "--json", "--micro-batch-max", "4", *extra)
OPTIONS = [
    ["--sharding", "fsdp", "--world-size", "2"], ["--activation-checkpointing"], ["--sharded-gradients"],
    ["--offload", "optimizer"], ["--quantize", "nf4"], ["--quantize", "int8"], ["--batchnorm", "sync"],
    ["--batchnorm", "frozen"], ["--packing", "sorted"], ["--packing", "packed", "--token-budget", "4096"],
    ["--set", "optimizer.lr=0.5"], ["--set", "batch.effective=128", "--set", "schedule.warmup.steps=3"],
    ["--set", "data.max_length=64"], ["--set", "nope.x=1"], ["--data", "/nonexistent"], ["--weights", "/nonexistent"],
]
for name in ("digits-mlp", "pysource-gpt", "tloen2023-alpaca-lora", "hu2021-lora-gpt2m-e2e", "goyal2017-resnet50",
             "chen2017-deeplabv3", "shapes-mini-segmentation", "dettmers2023-qlora-guanaco-7b"):
    for option in OPTIONS:
        out[f"plan {name} {' '.join(option)}"] = cli("plan", name, "--json", "--micro-batch-max", "4", *option)
for name in ("digits-mlp", "pysource-gpt"):
    out[f"verify {name}"] = cli("verify", name, "--micro-batch-max", "8")
with tempfile.TemporaryDirectory() as tmp:
    for name, args in (("digits-mlp", ["--max-steps", "6", "--micro-batch-max", "32"]),
                       ("pysource-gpt", ["--max-steps", "3", "--micro-batch-max", "16"]),
                       ("shapes-mini-segmentation", ["--max-steps", "2", "--micro-batch-max", "4"])):
        folder = Path(tmp) / name
        code, text = cli("run", name, "--out", str(folder), "--seed", "3", "--no-noise-scale", *args)
        out[f"run {name}"] = {"code": code, "metrics": metrics(folder) if code == 0 else text,
                              "model.pt": sha(folder / "model.pt"), "plan.yaml": sha(folder / "plan.yaml")}
        code, text = cli("run", name, "--out", str(folder), "--resume", "--max-steps", "8", *args[2:])
        out[f"resume {name}"] = {"code": code, "model.pt": sha(folder / "model.pt"),
                                 "plan.yaml": sha(folder / "plan.yaml")}
Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True, default=str))
print(f"{len(out)} fingerprints in {sys.argv[1]}")
