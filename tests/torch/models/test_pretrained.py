"""Pretrained weights on disk: `model.weights` / `--weights PATH` (models/pretrained.py, weightfiles/).

Real files made here: a tiny LLaMA and a sharded GPT-2 saved with transformers' save_pretrained (random weights, but
"pretrained" files on disk all the same), a torchvision ResNet-50 state dict, nanoGPT's ckpt.pt. The loaded models
are compared with what transformers / torch load from the same files; bad input is one `error:` line, exit 2.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml

from helpers import cli, pretrained_files, snapshot
from reproduce.errors import UserError
from reproduce.plan.recipe import parse_recipe

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """tiny-llama/ and tiny-gpt2/ (3 shards) with a 512-token BPE tokenizer beside them, and alpaca.json."""
    return pretrained_files(tmp_path_factory.mktemp("pretrained"))


def lm(model: dict, **data) -> dict:
    return {
        "batch": {"effective": 4}, "task": "language-modeling", "model": model,
        "data": {"available": False, "format": "instructions", "template": "alpaca", "max_length": 160,
                 "shuffle": False, **data},
        "optimizer": {"name": "adamw", "lr": 1e-2}, "schedule": {"total": {"steps": 2}},
    }


def write(tmp_path, recipe: dict, name: str = "recipe.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return path


LLAMA_LORA = {"builtin": "llama-7b", "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"]}}


def test_a_llama_folder_trains_from_its_weights(files, tmp_path, capsys, one_thread):
    """The first step's loss is transformers' own loss of the loaded model on that micro-batch; after two steps the
    frozen base weights are the file's, bit for bit, and the adapters moved."""
    from safetensors.torch import load_file

    from reproduce.data import build_data

    recipe = write(tmp_path, lm(LLAMA_LORA))
    code, out, err = cli(capsys, "run", recipe, "--weights", files / "tiny-llama", "--data", files / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "2")
    assert code == 0, err
    assert f"weights: llama-7b's architecture from {files / 'tiny-llama'}'s config.json (LlamaForCausalLM" in out
    assert "FLOPs not counted" not in err  # counted on the folder's config, built on the meta device
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])

    reference = transformers.AutoModelForCausalLM.from_pretrained(files / "tiny-llama", local_files_only=True)
    planned = parse_recipe(yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["recipe"])
    train = build_data(planned).train  # (not shuffled: the first window is the first four records)
    rows = [train.ids[int(train.offsets[i]):int(train.offsets[i + 1])].long() for i in range(4)]
    ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0)
    labels = torch.full_like(ids, -100)
    for i, row in enumerate(rows):  # the response's tokens, -100 on the prompt's
        labels[i, :len(row)] = torch.where(train.mask[int(train.offsets[i]):int(train.offsets[i + 1])], row, -100)
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=labels).loss.item()  # transformers shifts the labels itself
    assert first["loss"] == pytest.approx(expected, rel=1e-5)

    trained = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    stored = load_file(files / "tiny-llama" / "model.safetensors")
    base = [key for key in trained if key.endswith("layers.0.self_attn.q_proj.base_layer.weight")]
    assert len(base) == 1
    assert torch.equal(trained[base[0]], stored["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(trained[next(k for k in trained if k.endswith("embed_tokens.weight"))],
                       stored["model.embed_tokens.weight"])
    lora_b = [key for key in trained if "lora_B" in key]
    assert lora_b and any(trained[key].abs().sum() > 0 for key in lora_b)  # B starts at zero: the adapters trained


def test_a_sharded_gpt2_folder_is_the_model_transformers_loads(files):
    """Three safetensors shards and an index; GPT-2's tied output head; the plan's parameter count from the headers."""
    from reproduce.model_facts import weights_of
    from reproduce.models import build_model, count_parameters
    from reproduce.plan.weightfiles import inspect

    recipe = parse_recipe(lm({"builtin": "gpt2-medium", "weights": str(files / "tiny-gpt2")},
                             available=True, path=str(files / "alpaca.json")))
    model = build_model(recipe)
    reference = transformers.AutoModelForCausalLM.from_pretrained(files / "tiny-gpt2", local_files_only=True)
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), reference(input_ids=ids).logits)
    assert len(inspect(str(files / "tiny-gpt2")).files) == 3
    from reproduce.plan.planner import make_plan

    record = make_plan(recipe, 4, 1, dataset_size=20, weights=weights_of(recipe)).weights
    assert record.parameters == count_parameters(model)[0] and record.kind == "folder"
    assert "n_layer 2 (24)" in record.differs and "n_embd 32 (1024)" in record.differs
    with torch.device("meta"):  # the estimate meter's build: the folder's config, no weights read
        assert count_parameters(build_model(recipe)) == count_parameters(model)


def test_a_torchvision_state_dict_loads_strictly(tmp_path):
    import torchvision

    from reproduce.models import build_model

    torch.manual_seed(3)
    saved = torchvision.models.resnet50(num_classes=10)
    torch.save(saved.state_dict(), tmp_path / "resnet50.pth")
    recipe = {"batch": {"effective": 4}, "task": "classification", "data": {"builtin": "digits"},
              "optimizer": {"name": "sgd", "lr": 0.1}, "schedule": {"total": {"steps": 1}},
              "model": {"builtin": "resnet50", "kwargs": {"num_classes": 10},
                        "weights": str(tmp_path / "resnet50.pth")}}
    model = build_model(parse_recipe(recipe))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), saved.state_dict().values(),
                                                  strict=True))
    recipe["model"]["kwargs"] = {}  # 1000 classes: the head's shapes differ
    with pytest.raises(UserError) as error:
        build_model(parse_recipe(recipe))
    assert error.value.lines == [
        f"model.weights: {tmp_path / 'resnet50.pth'}: its keys do not match resnet50's: 0 missing, 0 unexpected, "
        "2 of another shape (fc.weight: file [10, 2048], model [1000, 2048]; fc.bias: file [10], model [1000]); "
        "318 of the file's 320 tensors match"]


def test_nanogpt_ckpt_pt_loads_its_model_key(tmp_path):
    """nanoGPT's train.py saves {'model': raw_model.state_dict(), 'optimizer': ..., 'model_args': ..., ...}; under
    torch.compile every key starts with _orig_mod."""
    from reproduce.models import build_model
    from reproduce.models.nanogpt import GPT, GPTConfig

    shape = {"n_layer": 2, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 32}
    torch.manual_seed(5)
    saved = GPT(GPTConfig(**shape, bias=False))
    torch.save({"model": {"_orig_mod." + k: v for k, v in saved.state_dict().items()}, "model_args": shape,
                "iter_num": 5000, "best_val_loss": torch.tensor(1.47), "config": {"dataset": "shakespeare_char"}},
               tmp_path / "ckpt.pt")
    recipe = {"batch": {"effective": 4, "sequence_length": 16}, "task": "language-modeling",
              "data": {"factory": "factories:variable_lm"}, "optimizer": {"name": "adamw", "lr": 1e-3},
              "schedule": {"total": {"steps": 1}},
              "model": {"builtin": "nanogpt", "kwargs": shape, "weights": str(tmp_path / "ckpt.pt")}}
    model = build_model(parse_recipe(recipe))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.state_dict().items())
    recipe["model"]["kwargs"] = {**shape, "n_layer": 3}
    with pytest.raises(UserError, match=r"its keys do not match nanogpt's: 6 missing "
                                        r"\(transformer\.h\.2\.ln_1\.weight, .*0 unexpected, 0 of another shape; "
                                        r"16 of the file's 16 tensors match"):
        build_model(parse_recipe(recipe))


@pytest.mark.parametrize("case", ["missing", "no-config", "no-weights", "wrong-suffix", "small-vocabulary",
                                  "not-transformers", "other-family"])
def test_bad_weights_are_one_line_and_nothing_written(case, files, tmp_path, capsys, one_thread):
    model, weights = dict(LLAMA_LORA), tmp_path / "weights"
    expected = {
        "missing": f"model.weights: {weights}: no such file or folder",
        "no-config": f"model.weights: {weights}: the folder has no config.json",
        "no-weights": f"model.weights: {weights}: the folder has config.json but no weights",
        "wrong-suffix": f"model.weights: {weights}.npz: expected a state dict file",
        "small-vocabulary": f"model.weights: the data has 512 token ids but {weights} has a vocabulary of 100",
        "not-transformers": f"model.weights: {weights} is a Hugging Face folder, whose config.json is a transformers "
                            "architecture; the built-in nanogpt is not one",
        "other-family": f"model.weights: {weights} holds a gpt2 model (GPT2LMHeadModel), and the built-in llama-7b is "
                        f"a llama one: give a llama folder, or name the folder's own architecture with model: "
                        f"{{hf: {weights}}}",
    }[case]
    if case == "no-config":
        weights.mkdir()
        shutil.copy(files / "tiny-llama" / "model.safetensors", weights)
    elif case in ("no-weights", "small-vocabulary", "not-transformers"):
        shutil.copytree(files / "tiny-llama", weights, ignore=shutil.ignore_patterns("*.safetensors"))
        if case != "no-weights":
            from reproduce.data.samples import write_model

            write_model("Llama", weights, files / "tokenizer", vocab_size=100, num_hidden_layers=1)
        if case == "not-transformers":
            model = {"builtin": "nanogpt"}
    elif case == "other-family":
        shutil.copytree(files / "tiny-gpt2", weights)
    elif case == "wrong-suffix":
        weights = tmp_path / "weights.npz"
        weights.write_bytes(b"\0" * 16)
    recipe = write(tmp_path, lm(model))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", recipe, "--weights", weights, "--data", files / "alpaca.json", "--out",
                         tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu")
    assert code == 2 and out == ""
    assert err.startswith(f"error: {expected}") and err.count("\n") == 1, err
    assert snapshot(tmp_path) == before


def test_resume_refuses_other_weights(files, tmp_path, capsys, one_thread):
    """The plan.yaml records the weights' fingerprint: changed weights, or other ones, cannot continue the run."""
    weights = tmp_path / "llama"
    shutil.copytree(files / "tiny-llama", weights)
    recipe = write(tmp_path, lm({**LLAMA_LORA, "weights": str(weights)}))
    common = ("--out", tmp_path / "run", "--device", "cpu", "--data", files / "alpaca.json")
    code, _, err = cli(capsys, "run", recipe, *common, "--micro-batch-max", "4", "--max-steps", "1")
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())
    assert saved["weights"]["path"] == str(weights) and saved["weights"]["fingerprint"].startswith("sha256:")
    plan_file = tmp_path / "run" / "plan.yaml"
    code, _, err = cli(capsys, "run", plan_file, "--out", tmp_path / "run", "--resume", "--weights",
                       files / "tiny-llama", "--device", "cpu")
    assert code == 2 and err.startswith(f"error: --weights: the run in {tmp_path / 'run'} was started with "
                                                 f"model.weights {weights}")

    from safetensors.torch import load_file, save_file

    tensors = load_file(weights / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2  # same shapes, same size: other content
    save_file(tensors, weights / "model.safetensors", metadata={"format": "pt"})
    before = snapshot(tmp_path / "run")
    code, out, err = cli(capsys, "run", plan_file, "--out", tmp_path / "run", "--resume", "--device", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: --resume: the weights {weights} changed since the run in {tmp_path / 'run'} "
                          f"started (fingerprint {saved['weights']['fingerprint']} in its plan.yaml, sha256:")
    assert snapshot(tmp_path / "run") == before


def test_the_fingerprint_follows_the_content_not_the_path(files, tmp_path):
    from reproduce.plan.weightfiles import fingerprint_of, inspect

    shutil.copytree(files / "tiny-gpt2", tmp_path / "copy")
    assert fingerprint_of(inspect(str(tmp_path / "copy"))) == fingerprint_of(inspect(str(files / "tiny-gpt2")))
    config = json.loads((tmp_path / "copy" / "config.json").read_text())
    (tmp_path / "copy" / "config.json").write_text(json.dumps({**config, "n_positions": 256}))
    assert fingerprint_of(inspect(str(tmp_path / "copy"))) != fingerprint_of(inspect(str(files / "tiny-gpt2")))


def test_plan_counts_the_data_as_run_does(files, tmp_path, capsys, one_thread):
    """`plan --data` reads the data: the epochs' optimizer steps without data.train_size."""
    recipe = lm(LLAMA_LORA)
    recipe["schedule"] = {"total": {"epochs": 2}}
    path = write(tmp_path, recipe)
    code, out, err = cli(capsys, "plan", path, "--weights", files / "tiny-llama", "--data", files / "alpaca.json",
                         "--micro-batch-max", "2", "--json")
    assert code == 0, err
    planned = json.loads(out)
    assert planned["dataset_size"] == 24 and planned["optimizer_steps"] == 12
    assert planned["weights"]["path"] == str(files / "tiny-llama")


def test_the_adapter_and_the_merged_model_load_as_users_load_them(files, tmp_path, capsys, one_thread):
    """adapter/ is peft's save_pretrained folder, put on transformers' own model of the weights folder; merged/ is a
    Hugging Face folder from_pretrained loads alone. Both give the trained model's logits (GPT-2: peft's Conv1D)."""
    import peft

    from reproduce.models import build_model

    model = {"builtin": "gpt2-medium", "lora": {"r": 2, "alpha": 4, "target_modules": ["c_attn"]}}
    recipe = write(tmp_path, lm(model))
    code, out, err = cli(capsys, "run", recipe, "--weights", files / "tiny-gpt2", "--data", files / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "2",
                         "--merged")
    assert code == 0, err
    assert "checkpoints/last.pt, adapter/, merged/" in " ".join(out.split())
    planned = parse_recipe(yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["recipe"])
    trained = build_model(planned)
    trained.load_state_dict(torch.load(tmp_path / "run" / "model.pt", weights_only=True))
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        expected = trained.eval()(ids)
        base = transformers.AutoModelForCausalLM.from_pretrained(files / "tiny-gpt2", local_files_only=True).eval()
        assert not torch.allclose(base(input_ids=ids).logits, expected, atol=1e-4)  # the adapters trained
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
        assert torch.equal(adapted(input_ids=ids).logits, expected)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", local_files_only=True)
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(files / "tiny-gpt2") and config["task_type"] == "CAUSAL_LM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "run" / "merged")
    assert len(tokenizer) == 512
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["adapter"] == str(tmp_path / "run" / "adapter")


def test_merged_on_a_quantised_base_is_the_folders_weights_with_the_adapters(files, tmp_path, capsys, one_thread,
                                                                               monkeypatch):
    """On an int8 base, merged/ is the weights folder's unquantised model with the run's adapters merged in (as
    Alpaca-LoRA's export_hf_checkpoint.py merges): no 8-bit tensors in it, from_pretrained alone gives the logits of
    the adapter on the folder's model. Without a weights folder to merge into: one line, before any step."""
    import peft
    from safetensors import safe_open

    recipe = write(tmp_path, lm({**LLAMA_LORA, "quantize": "int8"}))
    code, out, err = cli(capsys, "run", recipe, "--weights", files / "tiny-llama", "--data", files / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "2",
                         "--merged")
    assert code == 0, err
    with safe_open(str(tmp_path / "run" / "merged" / "model.safetensors"), "pt") as merged_file:
        names = list(merged_file.keys())
        assert not [n for n in names if n.endswith((".SCB", ".weight_format"))]
        q_proj = merged_file.get_tensor("model.layers.0.self_attn.q_proj.weight")
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(files / "tiny-llama", local_files_only=True).eval()
        assert q_proj.dtype == torch.float32
        assert not torch.equal(q_proj, base.model.layers[0].self_attn.q_proj.weight)  # the adapters merged in
        adapted = peft.PeftModel.from_pretrained(base, tmp_path / "run" / "adapter").eval()
        expected = adapted(input_ids=ids).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "merged", local_files_only=True)
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)

    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))  # tests/factories.py: a GPT-2 of random weights
    sys.modules.pop("factories", None)
    random_base = {"factory": "factories:transformers_gpt2", "quantize": "int8",
                   "lora": {"r": 2, "alpha": 4, "target_modules": ["c_attn"]}}
    no_folder = write(tmp_path, lm(random_base, tokenizer=str(files / "tokenizer")), "r2.yaml")
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", no_folder, "--data", files / "alpaca.json", "--out", tmp_path / "run2",
                         "--micro-batch-max", "4", "--device", "cpu", "--merged")
    assert code == 2 and err == ("error: --merged: on an int8 base the adapters merge into the base's own weights "
                                 "folder (model.weights or --weights: a Hugging Face folder), read again unquantised; "
                                 "this run has none, so adapter/ holds its adapters\n")
    assert snapshot(tmp_path) == before


def test_merged_needs_lora(files, tmp_path, capsys, one_thread):
    recipe = write(tmp_path, lm({"builtin": "gpt2-medium"}))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", recipe, "--weights", files / "tiny-gpt2", "--data", files / "alpaca.json",
                         "--out", tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--merged")
    assert code == 2 and err == ("error: --merged: the recipe trains no LoRA adapters (model.lora) to merge; model.pt "
                                 "is the trained model\n")
    assert snapshot(tmp_path) == before


def test_the_own_weights_page_runs_as_documented(tmp_path, capsys, monkeypatch, one_thread):
    """docs/own-weights.md: each `$` command as the page shows it (the shipped Alpaca-LoRA recipe by name, unedited,
    on a LLaMA folder and a JSON file through --weights and --data), and the lines it shows printed, but for times."""
    import runpy
    import shlex
    import sys
    from pathlib import Path

    import reproduce
    from reproduce.data.samples import main as samples

    root, package = Path(__file__).parents[3], str(Path(reproduce.__file__).parent)  # (the shipped recipe's)
    page = (root / "docs" / "own-weights.md").read_text()
    blocks = [block.split("\n```")[0] for block in page.split("```\n$ ")[1:]]
    assert [block.split()[:2] for block in blocks] == [["python", "-m"], ["reproduce", "plan"], ["reproduce", "run"],
                                                       ["python", "examples/own-weights/load.py"],
                                                       ["python", "examples/own-weights/compare.py"],
                                                       ["reproduce", "run"], ["reproduce", "run"]]
    shutil.copytree(root / "examples" / "own-weights", tmp_path / "examples" / "own-weights")
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        command, *shown = block.splitlines()
        args = shlex.split(command)
        if args[0] == "reproduce":
            code, out, err = cli(capsys, *args[1:])
        else:
            if args[:2] == ["python", "-m"]:
                code = samples(args[3:])
            else:
                monkeypatch.setattr(sys, "argv", args[1:])
                runpy.run_path(args[1], run_name="__main__")
                code = 0
            out, err = capsys.readouterr()
        printed = " ".join((out + err).split())
        assert code == (2 if "--resume" in args else 0), printed
        for line in shown:  # the table's rows are wrapped to the terminal; times vary
            skipped = ("step ", "done: ", "runs/alpaca/loss.svg", "runs/guanaco/loss.svg")
            if line[0] in "┏┃┡│└" or line.startswith(skipped) or not line.strip():
                continue
            line = re.sub(r"\S+/src/reproduce/shipped", package + "/shipped", line.replace("/tmp/ft2", str(tmp_path)))
            assert " ".join(line.split()) in printed, line
    assert (tmp_path / "runs" / "alpaca" / "merged" / "config.json").is_file()


@pytest.mark.parametrize("factory", ["transformers_gpt2", "gpt2_from_pretrained", "gpt2_output_wrapper"])
def test_a_factory_of_a_transformers_model(factory, files, tmp_path, capsys, one_thread, monkeypatch):
    """A factory returning transformers' model trains (its logits taken); one that calls from_pretrained trains with
    a note in words on the FLOPs; a module returning a ModelOutput is one line."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[2]))  # tests/factories.py
    sys.modules.pop("factories", None)
    kwargs = {"folder": str(files / "tiny-gpt2")} if factory == "gpt2_from_pretrained" else {}
    recipe = write(tmp_path, lm({"factory": f"factories:{factory}", "kwargs": kwargs},
                                tokenizer=str(files / "tokenizer")))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", recipe, "--data", files / "alpaca.json", "--out", tmp_path / "run",
                         "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "1")
    if factory == "gpt2_output_wrapper":
        assert code == 2 and out == "" and err == (
            "error: model: its forward returns CausalLMOutputWithCrossAttentions, not a tensor of logits; return "
            "output.logits from it, or have the factory return the transformers model itself (reproduce takes its "
            "logits)\n")
        assert snapshot(tmp_path) == before
        return
    assert code == 0, err
    assert "done: 1 steps" in out
    if factory == "gpt2_from_pretrained":
        assert "note: FLOPs not counted: they are counted on a model built without memory (the meta device), and " \
               "this model's factory loads weights, which needs real memory; give the weights as model.weights " \
               "instead" in " ".join(err.split())
    else:
        assert "FLOPs not counted" not in err


def test_verify_and_probe_take_weights(files, tmp_path, capsys, one_thread):
    """--weights on verify (the accumulated LoRA gradient of the loaded model is the one-pass one) and on probe."""
    recipe = write(tmp_path, lm(LLAMA_LORA))
    common = ("--weights", files / "tiny-llama", "--data", files / "alpaca.json")
    code, out, err = cli(capsys, "verify", recipe, *common, "--micro-batch-max", "2")
    assert code == 0, err
    assert "the plan's 2 micro-batch(es) give the one-pass gradient within 1e-10" in " ".join(out.split())
    code, out, err = cli(capsys, "probe", recipe, *common, "--meter", "cpu", "--memory", "2GiB", "--no-cache")
    assert code == 0, err
    assert "largest micro-batch: 4" in out


def test_the_shipped_e2e_recipe_reads_context_completion_records(files, tmp_path):
    """papers/hu2021-lora-gpt2m-e2e.yaml reads format_converting_e2e.py's records with --data: the context, the
    tokenizer's EOS, ' ' + the completion, EOS (gpt2_encode.py --add_bos --add_eos); the loss on the completion."""
    from helpers import data_paths, weights_of
    from reproduce.data import build_data
    from reproduce.plan.recipe import load_recipe

    records = [{"context": "name : The Eagle | food : French", "completion": "The Eagle serves French food."}] * 3
    (tmp_path / "e2e.json").write_text(json.dumps(records))
    from pathlib import Path

    paper = Path(__file__).parents[3] / "papers" / "hu2021-lora-gpt2m-e2e.yaml"
    recipe = weights_of(load_recipe(paper), str(files / "tiny-gpt2"))
    train = build_data(data_paths(recipe, str(tmp_path / "e2e.json"), None)).train
    tokenizer = transformers.AutoTokenizer.from_pretrained(files / "tiny-gpt2")
    eos = tokenizer.eos_token
    assert eos
    prompt = tokenizer(records[0]["context"] + eos)["input_ids"]
    full = tokenizer(records[0]["context"] + eos + " " + records[0]["completion"] + eos)["input_ids"]
    assert train.ids[int(train.offsets[0]):int(train.offsets[1])].tolist() == full
    borne = [False] * len(prompt) + [True] * (len(full) - len(prompt))  # the loss on the completion's tokens only
    assert train.mask[:len(full)].tolist() == borne and len(train) == 3


def test_the_adapter_of_a_model_that_is_not_a_transformers_one(tmp_path):
    """nanoGPT with LoRA: adapter/ is peft's save_pretrained folder as it is, put on a fresh GPT of the same weights."""
    import peft

    from reproduce.models import build_model
    from reproduce.models.weights import check_merged, save_adapter

    shape = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 32}
    recipe = parse_recipe({
        "batch": {"effective": 4, "sequence_length": 16}, "task": "language-modeling",
        "data": {"factory": "factories:variable_lm"}, "optimizer": {"name": "adamw", "lr": 1e-3},
        "schedule": {"total": {"steps": 1}},
        "model": {"builtin": "nanogpt", "kwargs": shape, "lora": {"r": 2, "alpha": 4, "target_modules": ["c_attn"]}}})
    torch.manual_seed(0)
    model = build_model(recipe)
    torch.manual_seed(0)
    plain = {**recipe.model_dump(mode="json"), "model": {"builtin": "nanogpt", "kwargs": shape}}
    base = build_model(parse_recipe(plain))
    assert type(base).__name__ == "GPT"
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_()  # as if trained
    assert save_adapter(model, tmp_path / "adapter", recipe)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    ids = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids), model.eval()(ids))
    with pytest.raises(UserError, match=r"^`merged`: nanogpt is not a transformers model, so it has no Hugging Face "
                                        r"folder; model.pt holds its weights and adapter/ its adapters$"):
        check_merged(model, recipe)


def test_a_larger_vocab_size_widens_the_folder_embeddings_and_the_plan_says_so(files):
    """Alpaca's train.py adds [PAD] to LLaMA's 32000 tokens (taori2023-alpaca-7b: kwargs vocab_size 32001): the
    folder's embedding and output rows are kept, the new ones are their mean."""
    from safetensors.torch import load_file

    from reproduce.model_facts import weights_of
    from reproduce.models import build_model
    from reproduce.plan.planner import make_plan

    model = {"builtin": "llama-7b", "kwargs": {"vocab_size": 515}, "weights": str(files / "tiny-llama")}
    recipe = parse_recipe(lm(model, available=True, path=str(files / "alpaca.json")))
    stored = load_file(files / "tiny-llama" / "model.safetensors")
    model = build_model(recipe)
    embedding = model.model.get_input_embeddings().weight
    assert embedding.shape[0] == 515 and torch.equal(embedding[:512], stored["model.embed_tokens.weight"])
    torch.testing.assert_close(embedding[512:], stored["model.embed_tokens.weight"].mean(0).expand(3, -1))
    line = make_plan(recipe, 4, 1, dataset_size=24, weights=weights_of(recipe)).weights.line("llama-7b")
    assert "; model.kwargs vocab_size 515 widens its embeddings, the new rows the mean of the others;" in line
