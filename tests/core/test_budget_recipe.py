"""The recipe's `budget:` section (plan/recipe/recipe.py): strict, one line a problem, settable with `--set`."""

from __future__ import annotations

import pytest

from reproduce.errors import UserError
from reproduce.plan.overlay import changes_of, overlay
from reproduce.plan.recipe import Budget, load_recipe

GPT = "papers/pysource-gpt.yaml"


def test_no_budget_unless_given():
    assert load_recipe(GPT).budget is None


def test_set_makes_the_section():
    recipe = overlay(load_recipe(GPT), changes_of(["budget.gpu_hours=40"]), "the recipe")
    assert recipe.budget == Budget(gpu_hours=40.0)
    assert recipe.budget.money is None and recipe.budget.currency is None
    money = changes_of(["budget.money=500", "budget.price=2.5", "budget.currency=EUR"])
    recipe = overlay(recipe, money, "the recipe")
    assert (recipe.budget.gpu_hours, recipe.budget.money, recipe.budget.price, recipe.budget.currency) == (
        40.0, 500.0, 2.5, "EUR")


@pytest.mark.parametrize("override, expected", [
    ("budget.gpu_hours=0", "`overrides`: budget.gpu_hours: must be > 0"),
    ("budget.gpu_hours=-3", "`overrides`: budget.gpu_hours: must be > 0"),
    ("budget.gpu_hours=true", "`overrides`: budget.gpu_hours: expected a number"),
    ("budget.gpu_hour=4", "`overrides`: budget.gpu_hour: unknown key (did you mean 'gpu_hours'?)"),
    ("budget.price=2", "`overrides`: budget: give gpu_hours or money (or both)"),
    ("budget.money=.inf", "`overrides`: budget.money: "),
])
def test_a_bad_budget_is_one_line(override, expected):
    with pytest.raises(UserError) as caught:
        overlay(load_recipe(GPT), changes_of([override]), "the recipe")
    assert len(caught.value.lines) == 1
    assert caught.value.lines[0].startswith(expected), caught.value.lines[0]


def test_the_file_form(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(open(GPT).read() + "\nbudget: {gpu_hours: 2.5, money: 10, price: 4}\n")
    recipe = load_recipe(path)
    assert recipe.budget == Budget(gpu_hours=2.5, money=10, price=4)
    path = tmp_path / "bad.yaml"
    path.write_text(open(GPT).read() + "\nbudget: {}\n")
    with pytest.raises(UserError) as caught:
        load_recipe(path)
    assert caught.value.lines == [f"{path}: budget: give gpu_hours or money (or both): the most the whole run may "
                                  "cost"]
