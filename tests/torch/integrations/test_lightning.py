"""`reproduce.integrations.lightning.ExactAccumulation`: a Lightning module trained with it takes the one-pass
large batch's updates (float64, 1e-12) on token losses of unequal counts and an epoch whose last window is partial,
where Lightning's own `accumulate_grad_batches` (a mean loss per micro-batch, divided by N) does not."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

import reproduce
from helpers import TESTS
from reproduce.errors import UserError

pl = pytest.importorskip("lightning.pytorch")
from reproduce.integrations.lightning import ExactAccumulation  # noqa: E402

sys.path.insert(0, str(TESTS))
import accumulator_worker as worker  # noqa: E402  (the model, data and one-pass loop of tests/torch/test_accumulate.py)

MICRO_BATCH = 2  # 11 batches: windows of 4, 4 and 3 micro-batches = the worker's 8, 8 and 6 sequences


class TinyModule(pl.LightningModule):
    def __init__(self, summed: bool, manual: bool = False):
        super().__init__()
        self.model, self.tokens, self.targets = worker.model_and_data()
        self.summed = summed
        self.automatic_optimization = not manual
        self.kept: list = []

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = worker.summed_loss(self.model, tokens, targets)
        return loss if self.summed else loss / worker.tokens_of(targets)  # Lightning's usual: the batch's mean

    def configure_optimizers(self):
        optimizer, scheduler = worker.optimizer_of(self.model)
        self.kept = optimizer.kept
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self):
        dataset = torch.utils.data.TensorDataset(self.tokens, self.targets)
        return torch.utils.data.DataLoader(dataset, batch_size=MICRO_BATCH, shuffle=False)


def fit(module: TinyModule, accumulate: int, callbacks: list, clip: float | None = worker.CLIP) -> None:
    trainer = pl.Trainer(max_epochs=1, accumulate_grad_batches=accumulate, gradient_clip_val=clip,
                         accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no workers in the DataLoader, and the like)
        trainer.fit(module)


def test_the_callback_gives_the_one_pass_update_where_lightning_alone_does_not(one_thread):
    reference_grads, reference = worker.one_pass()
    plan = reproduce.plan_batch(worker.WINDOW, MICRO_BATCH, lr=worker.LR, optimizer="sgd")
    assert plan.accumulation_steps == 4
    exact = TinyModule(summed=True)
    callback = ExactAccumulation(plan)
    fit(exact, 1, [callback])  # accumulate_grad_batches comes from the plan
    assert len(exact.kept) == 3
    for ours, one_pass in zip(exact.kept, reference_grads, strict=True):
        for got, want in zip(ours, one_pass, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for name, value in exact.model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-12, atol=1e-14)

    plain = TinyModule(summed=False)  # Lightning's own accumulation: micro-batch means, each divided by N
    fit(plain, 4, [])
    assert len(plain.kept) == 3
    difference = max(float((plain.model.state_dict()[name] - value).abs().max()) for name, value in reference.items())
    assert difference > 1e-4
    first = max(float((a - b).abs().max()) for a, b in zip(plain.kept[0], reference_grads[0], strict=True))
    assert first > 1e-6  # already the first window's gradient differs


def test_manual_optimization_is_refused_in_one_line(one_thread):
    with pytest.raises(UserError, match="optimizes manually"):
        fit(TinyModule(summed=True, manual=True), 1, [ExactAccumulation()], clip=None)
