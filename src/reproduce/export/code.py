"""Python source emitted beside the settings: the plan's LR schedule, parameter groups and optimizer."""

from __future__ import annotations

from ..plan.planner import Plan
from .common import py_literal


def lr_factor_source(plan: Plan, name: str = "lr_factor") -> list[str]:
    """`def lr_factor(step)`: the LR of optimizer step `step` (0-based) over the peak, as `lr_at`, for LambdaLR."""
    peak, warmup = plan.lr, plan.warmup_steps
    lines = [
        f"def {name}(step):",
        f'    """The LR of optimizer step `step` (0-based) over the peak {peak!r}: the plan\'s schedule exactly."""',
    ]
    if warmup:
        start = plan.schedule.warmup_start_lr
        lines += [
            f"    if step < {warmup}:",
            f"        return ({start!r} + ({peak!r} - {start!r}) * step / {warmup}) / {peak!r}",
        ]
    kind = plan.schedule.decay_kind
    if kind == "constant":
        return [*lines, "    return 1.0"]
    if kind == "plateau":  # its decreases come at the run's evaluations: torch's ReduceLROnPlateau decides them
        return [*lines, "    return 1.0  # then x factor where ReduceLROnPlateau decides (plateau decay)"]
    if kind == "step":
        factor, milestones = plan.schedule.decay_factor, plan.schedule.decay_milestones
        return [*lines, f"    return {factor!r} ** sum(step >= m for m in {milestones!r})"]
    end = plan.schedule.decay_end_step if plan.schedule.decay_end_step is not None else plan.optimizer_steps
    if end is None or end <= warmup:
        return [*lines, "    return 1.0  # the run's length is unknown (dataset size), so no decay end: constant"]
    lines.append(f"    progress = min(1.0, max(0.0, (step - {warmup}) / ({end} - {warmup})))")
    low = plan.schedule.min_lr
    if kind == "cosine":
        lines.insert(2, "    import math")
        cosine = f"{low!r} + ({peak!r} - {low!r}) * 0.5 * (1 + math.cos(math.pi * progress))"
        return [*lines, f"    return ({cosine}) / {peak!r}"]
    if kind == "linear":
        return [*lines, f"    return ({peak!r} + ({low!r} - {peak!r}) * progress) / {peak!r}"]
    power = plan.recipe.schedule.decay.power
    return [*lines, f"    return ({low!r} + ({peak!r} - {low!r}) * (1 - progress) ** {power!r}) / {peak!r}"]


def schedule_words(plan: Plan) -> str:
    warm = f"warm-up {plan.warmup_steps} steps from lr {plan.schedule.warmup_start_lr:g}, " if plan.warmup_steps else ""
    kind = plan.schedule.decay_kind
    if kind == "step":
        decay = f"step decay x{plan.schedule.decay_factor:g} at steps {plan.schedule.decay_milestones}"
    elif kind in ("constant", "plateau"):
        decay = kind
    else:
        decay = f"{kind} decay to lr {plan.schedule.min_lr:.3g} at step {plan.schedule.decay_end_step}"
    return warm + decay


NORM_TYPES_SOURCE = [
    "    norms = (  # the norm layers reproduce run exempts for no_decay: norm",
    "        torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm,",
    '        torch.nn.modules.instancenorm._InstanceNorm, getattr(torch.nn, "RMSNorm", ()),',
    "    )",
]


# each kind of `optimizer.no_decay` as the test of a parameter `p`, named `name` in `module`, in this order
NO_DECAY_TESTS = {"bias": 'name == "bias"', "norm": "isinstance(module, norms)",
                  "embedding": "isinstance(module, torch.nn.Embedding)", "1d": "p.ndim < 2"}


def param_groups_source(plan: Plan) -> list[str]:
    """`def param_groups(model)`: the recipe's weight decay and `no_decay` split, as `reproduce run` makes it."""
    spec = plan.recipe.optimizer
    decay = spec.weight_decay
    if not spec.no_decay or decay == 0:
        return [
            "def param_groups(model):",
            f'    """Weight decay {decay!r} on every trainable parameter (the recipe has no no_decay)."""',
            f'    return [{{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": {decay!r}}}]',
        ]
    tests = [test for kind, test in NO_DECAY_TESTS.items() if kind in spec.no_decay]
    return [
        "def param_groups(model):",
        f'    """Weight decay {decay!r}, none on {", ".join(spec.no_decay)} (the recipe\'s no_decay)."""',
        "    import torch",
        "",
        *(NORM_TYPES_SOURCE if "norm" in spec.no_decay else []),
        "    decay, keep, seen = [], [], set()",
        "    for module in model.modules():",
        "        for name, p in module.named_parameters(recurse=False):",
        "            if not p.requires_grad or id(p) in seen:",
        "                continue",
        "            seen.add(id(p))",
        f"            excluded = {' or '.join(tests)}",
        "            (keep if excluded else decay).append(p)",
        f'    return [{{"params": decay, "weight_decay": {decay!r}}}, {{"params": keep, "weight_decay": 0.0}}]',
    ]


def optimizer_source(plan: Plan, params: str) -> str | None:
    """`torch.optim.X(params, ...)` for the recipe's optimizer at the plan's LR; None without a torch one."""
    spec = plan.recipe.optimizer
    lr = plan.lr
    if spec.name in ("sgd", "nesterov"):
        return f"torch.optim.SGD({params}, lr={lr!r}, momentum={spec.momentum!r}, nesterov={spec.name == 'nesterov'})"
    if spec.name in ("adam", "adamw"):
        cls = "Adam" if spec.name == "adam" else "AdamW"
        return f"torch.optim.{cls}({params}, lr={lr!r}, betas={py_literal(tuple(spec.betas))}, eps={spec.eps!r})"
    if spec.name == "adafactor":
        return f"torch.optim.Adafactor({params}, lr={lr!r}, eps=(None, {spec.eps!r}))"
    return None


def no_torch_optimizer_note(plan: Plan) -> str | None:
    name = plan.recipe.optimizer.name
    if name in ("lamb", "lars"):
        return (f"{name}: PyTorch has no {name.upper()} optimizer; reproduce's own is "
                f"reproduce.train.optim.large_batch.{name.upper()} (parameter groups from "
                f"reproduce.train.optim.optimizers.param_groups "
                f"with layer_adaptation=True), at lr {plan.lr:.6g}")
    return None
