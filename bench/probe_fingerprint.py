"""A fingerprint of the probe's path, which bench/cli_fingerprint.py never reaches (it passes `--micro-batch-max`):
`probe` and `plan --json` under the estimate meter (fake tensors: no real memory, deterministic) for GPUs and budgets
that fit, that need a technique, and that do not fit, plus the CPU meter on the small recipes (its tensors counted
against a budget). Timings are left out. Run it on both versions of a refactor and diff the JSON files.

    PYTHONPATH=src python bench/probe_fingerprint.py /tmp/probe-before.json      # about 5 minutes idle, 11 under load
"""
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMED = re.compile(r'"[a-z_]*(seconds|second|_s|time|elapsed)[a-z_]*": [-0-9.e]+,?'  # plan --json's timings
                   r"|\d[\d,.]* ?(s|ms|min|seconds?)\b|\d[\d,.]* [a-z]+/s\b|per second|\(\d[\d,.]* [a-z]+/s\)")


def masked(text: str) -> list[str]:
    """The text with its timings masked, and each table row cut to its first four cells (micro-batch, peak,
    tensors, result): the cells after them are times and rates, whose widths set the table's borders."""
    lines = []
    for line in TIMED.sub("<time>", text).splitlines():
        if line.startswith("\u2502"):
            lines.append("|".join(cell.strip() for cell in line.strip("\u2502").split("\u2502")[:4]))
        elif not line.startswith(("\u250f", "\u2503", "\u2521", "\u2514")):
            lines.append(line)
    return lines


def cli(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "reproduce", *args], capture_output=True, text=True, cwd=ROOT)
    return {"code": done.returncode, "lines": masked(done.stdout + "\n--stderr--\n" + done.stderr)}


ESTIMATE = {
    "digits-mlp": [["--gpu", "t4"], ["--memory", "64MiB"]],
    "pysource-gpt": [["--gpu", "t4"], ["--memory", "512MiB"]],
    "nanogpt-gpt2-124m": [["--gpu", "rtx4090"], ["--gpu", "a100-80gb"], ["--memory", "4GiB"]],
    "hu2021-lora-gpt2m-e2e": [["--gpu", "rtx4090"]],
    "goyal2017-resnet50": [["--gpu", "a100-80gb"], ["--memory", "2GiB"]],
    "tloen2023-alpaca-lora": [["--gpu", "rtx4090"]],
    "dettmers2023-qlora-guanaco-7b": [["--gpu", "rtx4090"]],
    "pysource-gpt-phases": [["--gpu", "t4"]],
}
CPU = {"digits-mlp": ["--memory", "64MiB"], "pysource-gpt": ["--memory", "256MiB"]}

out: dict[str, object] = {}
for name, cases in ESTIMATE.items():
    for case in cases:
        out[f"probe {name} {' '.join(case)}"] = cli("probe", name, "--meter", "estimate", "--no-cache", *case)
        out[f"plan {name} {' '.join(case)}"] = cli("plan", name, "--json", "--meter", "estimate", "--no-cache", *case)
for name, case in CPU.items():
    out[f"probe {name} cpu {' '.join(case)}"] = cli("probe", name, "--meter", "cpu", "--no-cache", *case)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1, sort_keys=True))
print(f"{len(out)} commands written to {sys.argv[1]}")
