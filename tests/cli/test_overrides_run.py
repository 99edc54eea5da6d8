"""`--set PATH=VALUE` on a run (plan/overlay.py; the recipe-level tests are tests/core/test_overrides.py): the
overridden fields are the run's recipe, kept in plan.yaml for its resume."""

from __future__ import annotations


def test_a_run_with_set_resumes_from_its_plan_and_refuses_a_plan_file_with_set(tmp_path, capsys, one_thread):
    """The overridden fields are the run's recipe (plan.yaml holds them): a resume from plan.yaml needs no --set,
    the same command again (as --auto-resume repeats it) is the same run, and --set on a plan file is refused."""
    from core_helpers import cli

    out = tmp_path / "run"
    code, _, err = cli(capsys, "run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", out, "--device",
                       "cpu", "--max-steps", "2", "--no-noise-scale", "--set", "optimizer.lr=0.05")
    assert code == 0, err
    assert load_recipe_plan(out).optimizer.lr == 0.05
    code, _, err = cli(capsys, "run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", out, "--device",
                       "cpu", "--max-steps", "3", "--no-noise-scale", "--resume", "--set", "optimizer.lr=0.05")
    assert code == 0, err
    code, _, err = cli(capsys, "run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", out, "--device",
                       "cpu", "--max-steps", "4", "--no-noise-scale", "--resume")  # without it: another recipe
    assert code == 2 and "differs from the one" in err
    code, _, err = cli(capsys, "run", out / "plan.yaml", "--out", out, "--device", "cpu", "--max-steps", "4",
                       "--no-noise-scale", "--resume")
    assert code == 0, err
    code, _, err = cli(capsys, "verify", out / "plan.yaml", "--set", "optimizer.lr=0.1")
    assert code == 2 and err.startswith(f"error: --set: {out / 'plan.yaml'} is a plan file")


def load_recipe_plan(out):
    from reproduce.plan.planfile import load_plan

    return load_plan(out / "plan.yaml").recipe
