"""A fine-tuner's data, checked and said before anything is written (data/text.py, models `check_context`).

Real tokenizers trained here (a 512-token byte-level BPE), real tiny LLaMA / GPT-2 folders saved with
save_pretrained, Alpaca records from the standard library's docstrings: nothing is downloaded. Bad input is one
`error:` line, exit 2, and the output folder (with another run's files, under --force) untouched.
"""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import cli, snapshot

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from reproduce.data.samples import train_tokenizer
    from reproduce.models.samples import write_alpaca_json, write_gpt2, write_llama

    root = tmp_path_factory.mktemp("finetune")
    train_tokenizer(root / "tokenizer", max_bytes=100_000)
    write_llama(root / "tiny-llama", root / "tokenizer", num_hidden_layers=1)
    write_gpt2(root / "tiny-gpt2", root / "tokenizer")
    write_alpaca_json(root / "alpaca.json", limit=24)
    no_eos = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    no_eos.eos_token = None
    no_eos.save_pretrained(root / "no-eos")
    return root


def recipe(tmp_path, model: dict, name: str = "recipe.yaml", **data) -> str:
    body = {"batch": {"effective": 4}, "task": "language-modeling", "model": model,
            "data": {"available": False, "format": "instructions", "template": "alpaca", "max_length": 160,
                     "shuffle": False, **data},
            "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"total": {"steps": 2}}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return str(path)


GPT2 = {"builtin": "gpt2-medium", "lora": {"r": 2, "alpha": 4, "target_modules": ["c_attn"]}}
LLAMA = {"builtin": "llama-7b", "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}}


@pytest.mark.parametrize(("model", "folder", "data", "expected"), [
    (GPT2, "tiny-gpt2", {"max_length": 1024},  # transformers' GPT-2 raised a 275-line IndexError
     "error: data.max_length: 1024 tokens is longer than gpt2-medium (its config.json in {files}/tiny-gpt2) takes "
     "(512 positions)\n"),
    (LLAMA, "tiny-llama", {"max_length": 4096},  # LLaMA ran past its positions silently
     "error: data.max_length: 4096 tokens is longer than llama-7b (its config.json in {files}/tiny-llama) takes "
     "(2048 positions)\n"),
    ({"hf": "{files}/tiny-llama"}, None, {"max_length": 2049},
     "error: data.max_length: 2049 tokens is longer than {files}/tiny-llama takes (2048 positions)\n"),
    (GPT2, "tiny-gpt2", {"max_length": 24},  # every prompt longer than 24 tokens: it trained at loss 0.0000
     "error: data.path: {files}/alpaca.json: none of its 24 examples has a target token: train_on_inputs is false "
     "and no example keeps a response token within data.max_length (24 tokens): raise data.max_length, or set "
     "data.train_on_inputs: true\n"),
], ids=["gpt2-context", "llama-context", "hf-context", "no-target-token"])
def test_lengths_are_one_line_before_force_removes_anything(model, folder, data, expected, files, tmp_path, capsys,
                                                             one_thread):
    model = json.loads(json.dumps(model).replace("{files}", str(files)))
    path = recipe(tmp_path, model, **data)
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("another run's\n")
    before = snapshot(tmp_path)
    weights = ("--weights", files / folder) if folder else ()
    code, stdout, err = cli(capsys, "run", path, *weights, "--data", files / "alpaca.json", "--out", out, "--force",
                            "--micro-batch-max", "4", "--device", "cpu")
    assert (code, err) == (2, expected.format(files=files))
    assert snapshot(tmp_path) == before


def test_what_tokenising_cut_is_said_with_counts(files, tmp_path, capsys, one_thread):
    """Truncated examples, examples whose response is cut off entirely, and a tokenizer without EOS are warnings
    on the console, with the counts summary.json keeps."""
    path = recipe(tmp_path, GPT2, max_length=160, tokenizer=str(files / "no-eos"))
    code, out, err = cli(capsys, "run", path, "--weights", files / "tiny-gpt2", "--data", files / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "1")
    assert code == 0, err
    info = json.loads((tmp_path / "run" / "summary.json").read_text())["data"]
    truncated, cut = info["train_truncated"], info["train_without_response_tokens"]
    assert 0 < cut < truncated < 24  # the recipe's prompts: some fit, some lose their response, most are cut
    lines = " ".join(err.split())
    assert (f"warning: {files / 'alpaca.json'}: {truncated} of 24 examples are longer than data.max_length (160 "
            "tokens): truncated, the end of the response and its EOS cut off") in lines
    assert (f"warning: {files / 'alpaca.json'}: {cut} of 24 examples keep no response token within data.max_length "
            "(160 tokens): they bear no loss") in lines
    assert (f"warning: data.tokenizer: {files / 'no-eos'} has no EOS token: the examples end without one, so the "
            "model does not learn where a response stops") in lines
