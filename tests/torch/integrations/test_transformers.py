"""`reproduce.integrations.transformers.PlanCallback`: a Trainer script takes its accumulation steps from the plan
made from the probe of its own step (`reproduce.probe_step`), runs N micro-batches per optimizer step, and a model
whose loss cannot take the window's item count is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reproduce
from reproduce.errors import UserError

transformers = pytest.importorskip("transformers")
from reproduce.integrations.transformers import PlanCallback, arguments  # noqa: E402

EFFECTIVE, LENGTH, VOCAB = 8, 12, 32


def tiny_gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    return transformers.GPT2LMHeadModel(config)


def samples(count: int) -> list[dict]:
    """Token sequences of unequal lengths, padded to LENGTH (labels -100 on the padding)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for index in range(count):
        ids = torch.randint(1, VOCAB, (LENGTH,), generator=generator)
        labels = ids.clone()
        labels[3 + index % (LENGTH - 3):] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def probed_plan(model: torch.nn.Module):
    """The plan from the probe of the user's own step (cpu meter), for a budget the whole batch of 8 does not fit."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = reproduce.Accumulator(model, optimizer)
    rows = samples(EFFECTIVE)

    def step(micro_batch: int) -> None:
        batches = [rows[:micro_batch]] * reproduce.PROBE_WINDOW
        with acc.window([sum(int((r["labels"] != -100).sum()) for r in b) for b in batches]) as window:
            for batch in batches:
                ids = torch.stack([r["input_ids"] for r in batch])
                logits = model(input_ids=ids).logits
                labels = torch.stack([r["labels"] for r in batch])
                window.backward(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                                reduction="sum"))

    roomy = reproduce.probe_step(step, cap=EFFECTIVE, model=model, optimizer=optimizer, memory="1GiB",
                                 meter="cpu", time_steps=False)
    peaks = {t.micro_batch: t.peak_bytes for t in roomy.trials}
    budget = int((peaks[2] + peaks[EFFECTIVE]) / 2 / 0.9)  # between 2 and 8 sequences, less 10% headroom
    probed = reproduce.probe_step(step, cap=EFFECTIVE, model=model, optimizer=optimizer, memory=budget,
                                  meter="cpu", time_steps=False)
    assert 2 <= probed.micro_batch_max < EFFECTIVE
    return reproduce.plan_batch(EFFECTIVE, probed.micro_batch_max, lr=1e-3, optimizer="adamw")


def test_a_trainer_takes_its_accumulation_steps_from_the_probe(tmp_path, one_thread):
    model = tiny_gpt()
    plan = probed_plan(model)
    assert plan.accumulation_steps > 1
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(1))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, learning_rate=1e-3, report_to=[],
                                          save_strategy="no", logging_strategy="no", use_cpu=True,
                                          disable_tqdm=True, **arguments(plan))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=samples(4 * EFFECTIVE),
                                   callbacks=[PlanCallback(plan)])
    assert trainer.args.gradient_accumulation_steps == plan.accumulation_steps
    trainer.train()
    assert trainer.state.global_step == 2
    assert len(forwards) == 2 * plan.accumulation_steps  # N micro-batches of the plan's size per optimizer step


class NoLossKwargs(torch.nn.Module):
    """A model whose forward takes no **kwargs: the Trainer cannot pass it the window's item count."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_gpt()

    def forward(self, input_ids, labels):
        return {"loss": self.inner(input_ids=input_ids, labels=labels).loss}


def test_a_model_whose_loss_cannot_count_the_window_is_refused(tmp_path, one_thread):
    plan = reproduce.plan_batch(EFFECTIVE, 2, lr=1e-3)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **arguments(plan))
    with pytest.raises(UserError, match="takes no num_items_in_batch"):
        transformers.Trainer(model=NoLossKwargs(), args=args, train_dataset=samples(8), callbacks=[PlanCallback(plan)])
