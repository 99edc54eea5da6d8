"""Target tokens per second of each way to group a window (data.packing: none, sorted, packed) against Hugging Face
Trainer as a user runs it (its padded default, `group_by_length`, `batch_rebalance`, and `DataCollatorWithFlattening`),
at the same effective batch, model and LoRA, in interleaved rounds.

    PYTHONPATH=src python bench/packing.py                       # 4,000 examples, 51 steps a setting, 2 rounds
    PYTHONPATH=src python bench/packing.py --samples 2000 --steps 26 --rounds 1   # a smaller run

The data: `long-tailed`, synthetic token sequences whose lengths are log-normal with median 178 and 90th percentile
414 (sigma 0.66, clipped to 16..512, as Alpaca is truncated to 512), the first 40% of each a prompt without loss;
thousands of them, so that the Trainer's `group_by_length` sorts within its megabatches of 50 optimizer steps' samples
(transformers' trainer_pt_utils.LengthGroupedSampler), as it does on a real set. The model: a small LLaMA (2 layers,
hidden 64, vocabulary 512, sdpa) with LoRA r 8 on q_proj and v_proj, float32 on the CPU, one torch thread. Each
setting runs `--steps` optimizer steps of `--effective` samples as `--micro` x accumulation; the first step is left
out (start-up: caches, the model's first call), so the default 51 steps time 50, one megabatch of group_by_length.

The rate is target tokens (the tokens with a loss: what the window's loss is divided by) per second of the timed
steps: the run's own `tokens` per step; the Trainer's counted by its collator from the very samples it batched. The
table ranks by the process's CPU seconds (one torch thread, so CPU time is the step's compute; on a machine shared
with other jobs the wall clock also counts the time the process waited for a core, which varied 2x from round to
round here), and shows the wall-clock rate beside it.
`paper's samples per step`: whether each optimizer step trains the samples the recipe's sampler draws (a random
window of the data); `group_by_length` does not: it chooses which examples share a step (by length).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
OURS = ("none", "sorted", "packed")
TRAINER = ("trainer padded", "trainer group_by_length", "trainer batch_rebalance", "trainer flattening")
KEEPS = {"trainer group_by_length": "no (chooses a step's examples by length)"}
PROMPT = 0.4


def long_tailed(samples: int, seed: int = 0) -> list[list[int]]:
    """Log-normal lengths, median 178 and 90th percentile 414 (sigma ln(414/178)/1.2816), clipped to 16..512."""
    generator = torch.Generator().manual_seed(seed)
    sigma = math.log(414 / 178) / 1.2816
    lengths = torch.exp(torch.randn(samples, generator=generator) * sigma + math.log(178))
    lengths = lengths.round().clamp(16, 512).long()
    return [torch.randint(3, 512, (int(n),), generator=generator).tolist() for n in lengths]


def as_texts(sequences: list[list[int]]) -> Any:
    """The loop's data contract (inputs tokens[:-1], targets labels[1:], the prompt's 40% without loss), held as a
    run holds tokenised instruction data (data/text.py's TokenisedTexts, as `format: instructions` builds it): each
    example's target count known from the start, so a window is counted without collating it."""
    from reproduce.data.text import TokenisedTexts

    return TokenisedTexts(sequences, [int(PROMPT * len(sequence)) for sequence in sequences])


def recipe(way: str, effective: int, steps: int, size: int) -> dict:
    return {
        "batch": {"effective": effective}, "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": LLAMA, "lora": LORA},
        "data": {"name": "bench", "available": False, "train_size": size, "packing": way},
        "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"total": {"steps": steps}},
    }


def ours(way: str, sequences: list[list[int]], effective: int, micro: int, steps: int) -> tuple[float, dict]:
    from reproduce.data import Datasets
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import parse_recipe
    from reproduce.train.trainer import RunRequest, train

    data = Datasets(train=as_texts(sequences), info={"name": "bench", "vocab_size": 512})
    spec = parse_recipe(recipe(way, effective, steps, len(sequences)))
    plan = make_plan(spec, micro_batch_max=micro, dataset_size=len(sequences))
    from reproduce.train.reporter import SilentReporter

    marks: list[tuple[float, float]] = []

    class Clock(SilentReporter):
        def step(self, record: dict) -> None:
            marks.append((time.perf_counter(), time.process_time()))

    with tempfile.TemporaryDirectory() as out:
        summary = train(plan, RunRequest(Path(out) / "run", device="cpu", no_noise_scale=True),
                        data=data, reporter=Clock())
        records = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["samples"] == effective for r in records)  # the paper's batch, every step
    tokens = sum(r["tokens"] for r in records[1:])
    rate = tokens / (marks[-1][0] - marks[0][0])
    return rate, {"cpu_rate": tokens / (marks[-1][1] - marks[0][1]), "padding": summary["padding_fraction"],
                  "micro_batches": statistics.mean(r["micro_batches"] for r in records)}


def trainer(setting: str, sequences: list[list[int]], effective: int, micro: int, steps: int) -> tuple[float, dict]:
    import transformers
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa"))
    model = get_peft_model(model, LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"],
                                             target_modules=LORA["target_modules"], lora_dropout=0.0))
    rows = []
    for sequence in sequences:
        labels = list(sequence)
        labels[: int(PROMPT * len(sequence))] = [-100] * int(PROMPT * len(sequence))
        rows.append({"input_ids": sequence, "labels": labels})
    counted: list[tuple[int, int, int]] = []  # per micro-batch: target tokens, input tokens, tokens computed
    flattening = transformers.DataCollatorWithFlattening()

    def collate(features: list[dict]) -> dict:
        targets = sum(sum(1 for t in f["labels"][1:] if t != -100) for f in features)
        inputs = sum(len(f["input_ids"]) for f in features)
        width = max(len(f["input_ids"]) for f in features)
        counted.append((targets, inputs, inputs if setting == "trainer flattening" else width * len(features)))
        if setting == "trainer flattening":
            return flattening(features)
        ids = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    marks: list[float] = []
    micro_batches: list[int] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))
            micro_batches.append(len(counted))

    strategy = {"trainer group_by_length": "group_by_length",
                "trainer batch_rebalance": "batch_rebalance"}.get(setting, "random")
    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=effective // micro,
            max_steps=steps, learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000,
            train_sampling_strategy=strategy, dataloader_num_workers=0, remove_unused_columns=False,
            disable_tqdm=True,
        )
        with contextlib.redirect_stdout(sys.stderr):  # its closing log line: not in the table
            transformers.Trainer(model=model, args=arguments, train_dataset=rows, data_collator=collate,
                                 callbacks=[Clock()]).train()
    timed = counted[micro_batches[0]: micro_batches[-1]]  # steps 2..K: the micro-batches after the first step's
    tokens = sum(t for t, _, _ in timed)
    padding = 1 - sum(i for _, i, _ in timed) / sum(c for _, _, c in timed)
    per_step = (micro_batches[-1] - micro_batches[0]) / max(1, len(marks) - 1)
    return tokens / (marks[-1][0] - marks[0][0]), {"cpu_rate": tokens / (marks[-1][1] - marks[0][1]),
                                                   "padding": padding, "micro_batches": per_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=51)
    parser.add_argument("--effective", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--settings", default=",".join(OURS + TRAINER))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    settings = args.settings.split(",")
    sequences = long_tailed(args.samples)
    lengths = sorted(len(s) for s in sequences)
    print(f"long-tailed: {len(sequences)} examples, tokens median {lengths[len(lengths) // 2]}, 90th percentile "
          f"{lengths[int(0.9 * len(lengths))]}, longest {lengths[-1]}; {args.effective} = {args.micro} x "
          f"{args.effective // args.micro} a step, {args.steps - 1} steps timed", file=sys.stderr, flush=True)
    results: dict = {}
    for round_ in range(args.rounds):  # interleaved: each setting once per round
        for setting in settings:
            run = ours if setting in OURS else trainer
            rate, extra = run(setting, sequences, args.effective, args.micro, args.steps)
            results.setdefault(setting, []).append((rate, extra))
            print(f"  round {round_ + 1} {setting}: {rate:,.0f} target tokens/s, {extra['cpu_rate']:,.0f} per CPU "
                  "second", file=sys.stderr, flush=True)
    wall = {s: statistics.median(r for r, _ in results[s]) for s in settings}
    rate = {s: statistics.median(extra["cpu_rate"] for _, extra in results[s]) for s in settings}
    trainers = [s for s in settings if s in TRAINER]
    best = max(rate[s] for s in trainers) if trainers else None
    print(f"| setting | target tokens per CPU second (median of {args.rounds}) | x none | x Trainer padded | "
          "x best Trainer | wall-clock tokens/s | padding | micro-batches per step | paper's samples per step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for setting in settings:
        extra = results[setting][-1][1]
        ratios = [f"{rate[setting] / rate[base]:.2f}" if base in rate else "-" for base in ("none", "trainer padded")]
        ratios.append(f"{rate[setting] / best:.2f}" if best else "-")
        print(f"| {setting} | {rate[setting]:,.0f} | {' | '.join(ratios)} | {wall[setting]:,.0f} | "
              f"{extra['padding']:.0%} | "
              f"{extra['micro_batches']:.2f} | {KEEPS.get(setting, 'yes')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
