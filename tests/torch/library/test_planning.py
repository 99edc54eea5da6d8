"""`reproduce.plan_recipe` and `reproduce.plan_batch` (library/planning.py): the plan `reproduce plan --json`
describes, from a recipe or from plain arguments."""

from __future__ import annotations

import pytest

import reproduce
from helpers import cli_json
from reproduce.cli.plan import plan_summary
from reproduce.errors import UserError


def test_the_plan_of_a_recipe_is_the_one_plan_json_describes(capsys, isolated):
    ours = plan_summary(reproduce.plan_recipe("digits-mlp", micro_batch_max=32))
    printed = cli_json(capsys, "plan", "digits-mlp", "--micro-batch-max", "32")
    assert {key: printed[key] for key in ours} == ours
    assert (ours["micro_batch"], ours["accumulation_steps"]) == (32, 8)


def test_a_plan_from_plain_arguments_splits_the_paper_s_batch_and_applies_the_lr_rule():
    tokens = reproduce.plan_batch(512, 3, unit="tokens", sequence_length=64, lr=6e-4)
    assert (tokens.micro_batch, tokens.accumulation_steps, tokens.effective_batch) == (2, 4, 8)  # 8 sequences
    assert tokens.split.exact and tokens.split.lr == 6e-4
    # the paper's 256 on 3 processes of at most 32 cannot be exact: the fast policy scales the LR by the linear rule
    fast = reproduce.plan_batch(256, 32, lr=0.1, optimizer="sgd", world_size=3, policy="fast")
    assert not fast.split.exact
    assert fast.split.lr == pytest.approx(0.1 * fast.split.effective_batch / 256)
    assert fast.lr_scaling.rule == "linear"


def test_a_wrong_unit_is_one_line_naming_the_argument():
    with pytest.raises(UserError, match="^`unit`: expected samples or tokens"):
        reproduce.plan_batch(64, 4, lr=0.1, unit="images")
