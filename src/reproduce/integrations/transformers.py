"""`PlanCallback`: the Hugging Face Trainer run on a `reproduce` plan.

Since transformers v4.46 the Trainer accumulates exactly when it passes `num_items_in_batch` (the window's label
tokens, summed over processes with `average_tokens_across_devices`) to a model whose forward takes `**kwargs` (or to
`compute_loss_func`). The callback sets the plan's accumulation steps and LR factor when the Trainer is built,
checks its micro-batch (fixed in the Trainer's constructor: build its arguments with `arguments(plan)`) and world
size, and refuses in one line what would not be exact: a loss that takes no `num_items_in_batch`, or tokens not
summed over several processes.
"""

from __future__ import annotations

import inspect
from typing import Any

import transformers

from ..errors import UserError

__all__ = ["PlanCallback", "arguments"]


def arguments(plan: Any) -> dict:
    """The TrainingArguments fields the plan fixes: per-device micro-batch and accumulation steps."""
    return {"per_device_train_batch_size": plan.micro_batch, "gradient_accumulation_steps": plan.accumulation_steps}


def _accepts_loss_kwargs(model: Any) -> bool:
    """What the Trainer decides for it (`model_accepts_loss_kwargs`): passing `num_items_in_batch` to the model."""
    if model is None:
        return True
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "accepts_loss_kwargs"):
        return bool(inner.accepts_loss_kwargs)
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in inspect.signature(inner.forward).parameters.values())


class PlanCallback(transformers.TrainerCallback):
    """`plan`: a `reproduce` plan. `loss_counts_items`: the Trainer's `compute_loss_func` divides by
    `num_items_in_batch` (then the model's own loss need not take it)."""

    def __init__(self, plan: Any, loss_counts_items: bool = False):
        self.plan = plan
        self.loss_counts_items = loss_counts_items

    def on_init_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        plan = self.plan
        if args.world_size != plan.world_size:
            raise UserError(f"the plan is for {plan.world_size} processes and the Trainer has {args.world_size}: "
                            f"plan again with `world_size` {args.world_size}", field="world_size")
        if args.per_device_train_batch_size * max(1, args.n_gpu) != plan.micro_batch:
            raise UserError(f"the Trainer was built with {args.per_device_train_batch_size} per device and the plan's "
                            f"micro-batch is {plan.micro_batch}: build TrainingArguments with "
                            "reproduce.integrations.transformers.arguments(plan)", field="per_device_train_batch_size")
        if not (self.loss_counts_items or _accepts_loss_kwargs(model)):
            raise UserError("the model's forward takes no num_items_in_batch (**kwargs), so the Trainer would divide "
                            "each micro-batch's mean loss by the accumulation steps, not the window's loss by its "
                            "items: give the Trainer a compute_loss_func that divides by num_items_in_batch and "
                            "PlanCallback(plan, loss_counts_items=True)", field="model")
        if plan.world_size > 1 and not args.average_tokens_across_devices:
            raise UserError("average_tokens_across_devices is off: each process would divide by its own items, not "
                            "the window's over every process; turn it on", field="average_tokens_across_devices")
        args.gradient_accumulation_steps = plan.accumulation_steps
        args.learning_rate = args.learning_rate * plan.split.lr_factor
