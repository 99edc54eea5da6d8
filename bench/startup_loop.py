"""The hand-written accumulation loop bench/startup.py times against `reproduce run` (a whole process each).

    python bench/startup_loop.py --steps 40 --out /tmp/loop

What a careful user writes for papers/digits-mlp.yaml without the tool, and nothing more: scikit-learn's digits
with the same stratified 80/20 split, the same MLP (64 -> 128 -> 128 -> 10), SGD with momentum 0.9 and weight
decay 1e-4 off the biases, 2 epochs of linear warm-up from 0.02 to 0.2 then cosine to 1% over the recipe's 300
steps, 256 samples a step as 8 micro-batches of 32 (each micro-batch's summed loss over the window's 256), the
last partial window of each epoch dropped, a loss line a step, the eval split's loss and accuracy at the end,
the weights saved. It imports torch and scikit-learn only (not `reproduce`). --freeze-at-exit: skip CPython's last
garbage collection at exit as `reproduce` does (cli.leave_to_the_os), to compare like with like.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

BATCH, MICRO, LR, START_LR, WARMUP_EPOCHS, EPOCHS, MIN_RATIO = 256, 32, 0.2, 0.02, 2, 60, 0.01


def digits() -> tuple[torch.Tensor, ...]:
    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target, dtype=torch.long)
    train, test = train_test_split(list(range(len(labels))), test_size=0.2, random_state=0, stratify=bunch.target)
    train, test = torch.tensor(sorted(train)), torch.tensor(sorted(test))
    return images[train], labels[train], images[test], labels[test]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--freeze-at-exit", action="store_true")
    args = parser.parse_args()
    if args.freeze_at_exit:
        atexit.register(gc.freeze)
    torch.set_flush_denormal(True)  # as `reproduce run` does on a CPU (the same arithmetic)
    x_train, y_train, x_test, y_test = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                          nn.Linear(128, 10))
    decay = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    keep = [p for name, p in model.named_parameters() if name.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 1e-4}, {"params": keep, "weight_decay": 0.0}],
                                lr=LR, momentum=0.9)
    per_epoch = len(y_train) // BATCH
    warmup, total = WARMUP_EPOCHS * per_epoch, EPOCHS * per_epoch

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (START_LR + (LR - START_LR) * step / warmup) / LR
        progress = (step - warmup) / (total - warmup)
        return MIN_RATIO + (1 - MIN_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    started = time.perf_counter()
    for step in range(args.steps):
        epoch, position = divmod(step, per_epoch)
        order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        window = order[position * BATCH:(position + 1) * BATCH]
        total_loss = 0.0
        for indices in window.split(MICRO):
            loss = F.cross_entropy(model(x_train[indices]), y_train[indices], reduction="sum") / BATCH
            loss.backward()
            total_loss += loss.item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step + 1}/{args.steps} loss {total_loss:.4f} lr {scheduler.get_last_lr()[0]:.4g}")
    model.eval()
    with torch.no_grad():
        logits = model(x_test)
        eval_loss = F.cross_entropy(logits, y_test).item()
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
    steps_seconds = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / "model.pt")
    print(f"done: eval loss {eval_loss:.4f}, eval accuracy {accuracy:.4f}; steps {steps_seconds:.2f}s")


if __name__ == "__main__":
    main()
