from __future__ import annotations

import pytest

from core_helpers import make_recipe


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny models run fastest so, and a loaded 2-core machine punishes
    oversubscription. The thread count is put back afterwards."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tensors_only(monkeypatch):
    """The estimate's GPU rules without what it adds beyond the tensors operators return (the fused attention
    backward's workspaces, the allowance on the activations: tests/torch/probe/test_estimate_allowance.py checks
    those), for the tests that hold the rules' count against real CPU tensors."""
    import reproduce.probe.fake_step as fake_step

    monkeypatch.setattr(fake_step, "UNSEEN_ACTIVATIONS", 0.0)
    monkeypatch.setattr(fake_step, "kernel_workspaces", dict)


@pytest.fixture
def probe_cache(tmp_path, monkeypatch):
    """The probe's cache in this test's own folder (REPRODUCE_CACHE_DIR), so no result is shared between tests."""
    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def isolated(tmp_path, monkeypatch, probe_cache, one_thread):
    """A probe or plan test in a folder of its own: the working directory, the probe's cache, one torch thread."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def recipe():
    return make_recipe()


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory):
    """Real data in every on-disk format, made here (reproduce.data.samples): digits PNGs in class folders, a BPE
    tokenizer trained on the standard library, its sources as uint16 token files, docstring instructions (JSONL
    and a save_to_disk dataset) and the digits as parquet. About 7 s, once per session."""
    from reproduce.data import samples

    root = tmp_path_factory.mktemp("sample-data")
    samples.write_images(root / "images")
    samples.train_tokenizer(root / "tokenizer", max_bytes=300_000)
    samples.write_tokens(root / "tokens", 300_000, root / "tokenizer")
    samples.write_instructions(root / "instructions", limit=300, tokenizer=root / "tokenizer")
    samples.write_hf_datasets(root / "hf", limit=300)
    return root
