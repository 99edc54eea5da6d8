"""Useful (non-padding) tokens per second of each way to group a window (data.packing: none, sorted, packed) against
Hugging Face Trainer with `train_sampling_strategy="group_by_length"` and with `DataCollatorWithFlattening`, at the
same effective batch, model and LoRA, in interleaved rounds.

    PYTHONPATH=src python bench/packing.py                  # both sets, 2 rounds; a few minutes on 2 shared cores

Two instruction sets: `sample`, the sample instructions the tests use (reproduce.data.samples: docstrings of the
standard library, tokenised with its BPE tokenizer, truncated to 512), and `long-tailed`, synthetic token sequences
whose lengths are log-normal (median 96, sigma 0.9, clipped to 16..512: a few dozen tokens for most examples, a
tail past 400, the shape of Alpaca's spread; not Alpaca's published figures), the first 40% of each a prompt without
loss. The model: a small LLaMA (2 layers, hidden 64, vocabulary 512, sdpa) with LoRA r 8 on q_proj and v_proj,
float32 on the CPU, one torch thread. Each setting runs `--steps` optimizer steps of `--effective` samples as
`--micro` x accumulation; the first step is left out of the rate (it builds caches).

Useful tokens are the input tokens of the samples a step trained on (tokens less the last, as the loop's data
contract takes them); the Trainer's are counted by its collator from the very samples it batched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 512}
LORA = {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}
OURS = ("none", "sorted", "packed")
TRAINER = ("trainer group_by_length", "trainer flattening")


def long_tailed(samples: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(samples, generator=generator) * 0.9 + torch.log(torch.tensor(96.0)))
    lengths = lengths.round().clamp(16, 512).long()
    return [torch.randint(3, 512, (int(n),), generator=generator).tolist() for n in lengths]


def sample_instructions(samples: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from reproduce.data import samples as sample_data
    from reproduce.data.text import instruction_texts, read_records

    root = Path(tempfile.mkdtemp(prefix="bench-packing-"))
    sample_data.train_tokenizer(root / "tokenizer", max_bytes=300_000)
    sample_data.write_instructions(root / "instructions", limit=samples, tokenizer=root / "tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    prompts, responses = instruction_texts(read_records(root / "instructions" / "train.jsonl", "data.path"), "alpaca")
    full = [p + r + (tokenizer.eos_token or "") for p, r in zip(prompts, responses, strict=True)]
    ids = tokenizer(full, truncation=True, max_length=512)["input_ids"]
    return [[t % 512 for t in sequence] for sequence in ids if len(sequence) >= 2]


def as_pairs(sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The loop's data contract: inputs tokens[:-1], targets labels[1:], the prompt's 40% without loss."""
    pairs = []
    for sequence in sequences:
        tokens = torch.tensor(sequence)
        labels = tokens.clone()
        labels[: int(0.4 * len(sequence))] = -100
        pairs.append((tokens[:-1], labels[1:]))
    return pairs


def recipe(way: str, effective: int, steps: int, size: int) -> dict:
    return {
        "batch": {"effective": effective}, "task": "language-modeling",
        "model": {"builtin": "llama-7b", "kwargs": LLAMA, "lora": LORA},
        "data": {"name": "bench", "available": False, "train_size": size, "packing": way},
        "optimizer": {"name": "adamw", "lr": 1e-3}, "schedule": {"total": {"steps": steps}},
    }


def ours(way: str, sequences: list[list[int]], effective: int, micro: int, steps: int) -> tuple[float, dict]:
    from reproduce.plan.planner import make_plan
    from reproduce.plan.recipe import parse_recipe
    from reproduce.train.trainer import RunOptions, train

    data = {"train": as_pairs(sequences), "info": {"name": "bench", "vocab_size": 512}}
    spec = parse_recipe(recipe(way, effective, steps, len(sequences)))
    plan = make_plan(spec, micro_batch_max=micro, dataset_size=len(sequences))
    with tempfile.TemporaryDirectory() as out:
        summary = train(plan, Path(out) / "run", RunOptions(device="cpu", data=data, noise_scale=False))
        records = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:]
    rate = sum(r["useful_tokens"] for r in timed) / sum(r["seconds"] for r in timed)
    return rate, {"padding": summary["padding_fraction"], "micro_batches": statistics.mean(r["micro_batches"]
                                                                                          for r in records)}


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
        labels[: int(0.4 * len(sequence))] = [-100] * int(0.4 * len(sequence))
        rows.append({"input_ids": sequence, "labels": labels})
    useful: list[int] = []  # input tokens of each micro-batch collated, as the loop counts them
    flattening = transformers.DataCollatorWithFlattening()

    def collate(features: list[dict]) -> dict:
        useful.append(sum(len(f["input_ids"]) - 1 for f in features))
        if setting == "trainer flattening":
            return flattening(features)
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros((len(features), width), dtype=torch.long)
        labels = torch.full((len(features), width), -100, dtype=torch.long)
        mask = torch.zeros((len(features), width), dtype=torch.long)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = torch.tensor(f["input_ids"]), torch.tensor(f["labels"]), 1
        return {"input_ids": ids, "labels": labels, "attention_mask": mask}

    marks: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=micro, gradient_accumulation_steps=effective // micro,
            max_steps=steps, learning_rate=1e-3, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000,
            train_sampling_strategy="group_by_length" if setting == "trainer group_by_length" else "random",
            dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True,
        )
        with contextlib.redirect_stdout(sys.stderr):  # its closing log line: not in the table
            transformers.Trainer(model=model, args=arguments, train_dataset=rows, data_collator=collate,
                                 callbacks=[Clock()]).train()
    per_step = effective // micro
    tokens = sum(useful[per_step: per_step * steps])  # steps 2..K
    return tokens / (marks[-1] - marks[0]), {"padding": None, "micro_batches": per_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="sample,long-tailed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--effective", type=int, default=32)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sets = {"sample": sample_instructions, "long-tailed": long_tailed}
    results: dict = {}
    for name in args.sets.split(","):
        sequences = sets[name](args.samples)
        lengths = sorted(len(s) for s in sequences)
        print(f"{name}: {len(sequences)} examples, tokens median {lengths[len(lengths) // 2]}, 95th percentile "
              f"{lengths[int(0.95 * len(lengths))]}, longest {lengths[-1]}", file=sys.stderr, flush=True)
        for round_ in range(args.rounds):  # interleaved: each setting once per round
            for setting in OURS + TRAINER:
                run = ours if setting in OURS else trainer
                rate, extra = run(setting, sequences, args.effective, args.micro, args.steps)
                results.setdefault((name, setting), []).append((rate, extra))
                print(f"  round {round_ + 1} {setting}: {rate:,.0f} useful tokens/s", file=sys.stderr, flush=True)
    print(f"| set | setting | useful tokens/s (median of {args.rounds}) | x none | x best Trainer | padding | "
          "micro-batches per window |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.sets.split(","):
        rate = {s: statistics.median(r for r, _ in results[(name, s)]) for s in OURS + TRAINER}
        best = max(rate[s] for s in TRAINER)
        for setting in OURS + TRAINER:
            extra = results[(name, setting)][-1][1]
            padding = f"{extra['padding']:.0%}" if extra["padding"] is not None else "-"
            print(f"| {name} | {setting} | {rate[setting]:,.0f} | {rate[setting] / rate['none']:.2f} | "
                  f"{rate[setting] / best:.2f} | {padding} | {extra['micro_batches']:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
