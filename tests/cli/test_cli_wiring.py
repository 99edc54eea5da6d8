"""The CLI wiring of the export and TensorBoard options (their logic is tested in test_export / test_tensorboard)."""

from __future__ import annotations

import pytest

from reproduce.cli import main


def test_plan_emit_prints_the_frameworks_settings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "papers/nanogpt-gpt2-124m.yaml", "--micro-batch-max", "12", "--world-size", "8", "--emit", "hf"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("# reproduce plan: micro-batch 12 x accumulation 5 x world 8 = 480 sequences")
    assert "per_device_train_batch_size=12" in out and "gradient_accumulation_steps=5" in out


def test_plan_emit_rejects_an_unknown_format_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "papers/goyal2017-resnet50.yaml", "--micro-batch-max", "32", "--emit", "keras",
              "--out", str(tmp_path / "plan.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --emit: expected one of hf, lightning, deepspeed, accelerate, torchrun, slurm (got 'keras')")
    assert not (tmp_path / "plan.yaml").exists()


def test_run_tensorboard_logs_scalars(tmp_path):
    pytest.importorskip("tensorboard",
                        reason="tensorboard is an optional extra (pip install 'reproduce-large-batch[tensorboard]')")
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "papers/digits-mlp.yaml", "--micro-batch-max", "32", "--out", str(tmp_path / "out"),
              "--max-steps", "3", "--tensorboard"])
    assert exit_info.value.code == 0
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))


def test_a_loss_prints_with_significant_digits():
    """A loss far below 1 (a fine-tune near convergence) is not rounded away: 2e-5 is not 0.0000."""
    from reproduce.cli.common import loss_text

    assert [loss_text(v) for v in (1.70531, 0.151034, 2e-5, 12.34567)] == ["1.7053", "0.15103", "2e-05", "12.346"]
