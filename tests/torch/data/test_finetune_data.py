"""A fine-tuner's data, checked and said before anything is written (data/text.py, models `check_context`).

Real tokenizers trained here (a 512-token byte-level BPE), real tiny LLaMA / GPT-2 folders saved with
save_pretrained, Alpaca records from the standard library's docstrings: nothing is downloaded. Bad input is one
`error:` line, exit 2, and the output folder (with another run's files, under --force) untouched.
"""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import cli, pretrained_files, snapshot

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = pretrained_files(tmp_path_factory.mktemp("finetune"), llama_layers=1)
    no_eos = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    no_eos.eos_token = None
    no_eos.save_pretrained(root / "no-eos")
    chat = transformers.AutoTokenizer.from_pretrained(root / "tokenizer")
    chat.chat_template = CHAT_TEMPLATE
    chat.save_pretrained(root / "chat-tokenizer")
    return root


# a ChatML-like template (the sample tokenizer has none): each turn "<|role|>\ncontent<eos>\n"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Red."}, {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "Blue, and green."}]


def write_jsonl(path, records: list) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


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
    on the console, with the counts summary.json keeps; the run says how many parameters train."""
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
    base = transformers.AutoModelForCausalLM.from_pretrained(files / "tiny-gpt2").num_parameters()
    adapters = 2 * 2 * (32 + 96)  # 2 layers' c_attn (32 in, 96 out) with A (r x in) and B (out x r), r 2
    assert f"parameters: {base + adapters:,}, of which {adapters:,} train (" in out


def chat_recipe(tmp_path, files, **data) -> str:
    return recipe(tmp_path, LLAMA, format="chat", tokenizer=str(files / "chat-tokenizer"), max_length=256,
                  template=None, **data)


@pytest.mark.parametrize("layout", ["messages", "sharegpt"])
def test_a_chat_file_trains_on_the_assistant_turns_only(layout, files, tmp_path, capsys, one_thread):
    """Rendered by the tokenizer's own chat template; the targets are the assistant turns' tokens (each turn's end
    of turn included), nothing of the system or user turns; ShareGPT's conversations read the same."""
    from reproduce.data import build_data
    from reproduce.plan.recipe import parse_recipe

    names = {"system": "system", "user": "human", "assistant": "gpt"}
    record = ({"messages": CONVERSATION} if layout == "messages" else
              {"conversations": [{"from": names[t["role"]], "value": t["content"]} for t in CONVERSATION]})
    path = write_jsonl(tmp_path / "chat.jsonl", [record] * 8)
    tokenizer = transformers.AutoTokenizer.from_pretrained(files / "chat-tokenizer")
    recipe_path = chat_recipe(tmp_path, files)
    loaded = parse_recipe({**yaml.safe_load(open(recipe_path)), "data": {
        **yaml.safe_load(open(recipe_path))["data"], "path": path, "available": True}})
    train = build_data(loaded).train
    inputs, labels = train[0]
    assert tokenizer.decode(labels[labels != -100]) == "Red.<|endoftext|>\nBlue, and green.<|endoftext|>\n"
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(inputs) + tokenizer.decode(labels[-1:]) == rendered
    everything = parse_recipe({**loaded.model_dump(mode="json"),
                               "data": {**loaded.data.model_dump(mode="json"), "train_on_inputs": True}})
    assert int((build_data(everything).train[0][1] != -100).sum()) == len(inputs)  # train_on_inputs: all

    code, out, err = cli(capsys, "run", recipe_path, "--weights", files / "tiny-llama", "--data", path, "--out",
                         tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu", "--max-steps", "1")
    assert code == 0, err
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["items"] == 4 * int((labels != -100).sum())


@pytest.mark.parametrize(("records", "tokenizer", "expected"), [
    ([{"messages": CONVERSATION[:2]}], "chat-tokenizer",
     "error: {data}: line 1: no assistant turn: nothing to train on (the loss covers the assistant's messages)\n"),
    ([{"messages": CONVERSATION}, {"messages": [{"role": "bot", "content": "Hi."}]}], "chat-tokenizer",
     "error: {data}: line 2: message 1: unknown role 'bot' (expected system, user, assistant)\n"),
    ([{"conversations": [{"from": "robot", "value": "Hi."}]}], "chat-tokenizer",
     "error: {data}: line 1: message 1: unknown from 'robot' (expected human, user, gpt, assistant, system)\n"),
    ([{"messages": CONVERSATION}], "tokenizer",
     "error: data.tokenizer: {files}/tokenizer has no chat template (chat_template in its tokenizer_config.json), "
     "which format chat renders conversations with; give a tokenizer that has one, or use format instructions\n"),
], ids=["no-assistant-turn", "unknown-role", "unknown-sharegpt-role", "no-chat-template"])
def test_bad_chat_input_is_one_line(records, tokenizer, expected, files, tmp_path, capsys, one_thread):
    data = write_jsonl(tmp_path / "chat.jsonl", records)
    path = recipe(tmp_path, LLAMA, format="chat", tokenizer=str(files / tokenizer), max_length=256, template=None)
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", path, "--weights", files / "tiny-llama", "--data", data, "--out",
                         tmp_path / "run", "--micro-batch-max", "4", "--device", "cpu")
    assert (code, err) == (2, expected.format(data=data, files=files))
    assert snapshot(tmp_path) == before


def test_eval_size_holds_examples_out_with_the_seed(files, tmp_path, capsys, one_thread):
    """data.eval_size: that many examples of the training file become the eval split, drawn with the recipe's seed
    (another seed, another draw), the rest train; the plan counts what trains; more than the file is one line."""
    from reproduce.data import Datasets, build_data
    from reproduce.plan.recipe import parse_recipe

    def built(seed: int, size: int = 6) -> Datasets:
        body = yaml.safe_load(open(recipe(tmp_path, GPT2, eval_size=size)))
        body["data"].update({"path": str(files / "alpaca.json"), "available": True,
                             "tokenizer": str(files / "tokenizer")})
        return build_data(parse_recipe({**body, "seed": seed}))

    whole = {tuple(built(0, 1).train.sequence(i)) for i in range(23)} | {tuple(built(0, 1).eval.sequence(0))}
    first, again, other = built(0), built(0), built(1)
    held = [tuple(first.eval.sequence(i)) for i in range(len(first.eval))]
    trained = [tuple(first.train.sequence(i)) for i in range(len(first.train))]
    assert (len(trained), len(held)) == (18, 6) and set(held) | set(trained) == whole and not set(held) & set(trained)
    assert held == [tuple(again.eval.sequence(i)) for i in range(6)]
    assert held != [tuple(other.eval.sequence(i)) for i in range(6)]

    code, out, err = cli(capsys, "plan", recipe(tmp_path, GPT2, eval_size=6), "--weights", files / "tiny-gpt2",
                         "--data", files / "alpaca.json", "--micro-batch-max", "4", "--json")
    assert code == 0, err
    assert json.loads(out)["dataset_size"] == 18
    code, out, err = cli(capsys, "run", recipe(tmp_path, GPT2, eval_size=24), "--weights", files / "tiny-gpt2",
                         "--data", files / "alpaca.json", "--out", tmp_path / "run", "--micro-batch-max", "4",
                         "--device", "cpu")
    assert (code, err) == (2, f"error: data.eval_size: 24 examples held out of {files / 'alpaca.json'}, which has 24: "
                              "none would be left to train on\n")


def test_a_folder_whose_tensors_do_not_fit_its_config_is_one_line(files, tmp_path, capsys, one_thread):
    """Not transformers' coloured load report (17 lines, then a RuntimeError pointing at it): one line naming the
    tensors of another shape, with both shapes."""
    import shutil

    bad = tmp_path / "bad-llama"
    shutil.copytree(files / "tiny-llama", bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    before = snapshot(tmp_path)
    code, out, err = cli(capsys, "run", recipe(tmp_path / "..", LLAMA, name=f"{tmp_path.name}.yaml"), "--weights", bad,
                         "--data", files / "alpaca.json", "--out", tmp_path / "run", "--micro-batch-max", "4",
                         "--device", "cpu")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: model.weights: {bad}: its weights do not cover LlamaForCausalLM of its config: 0 "
                          "missing, 3 of another shape (model.layers.0.mlp.")
    assert "file [128, 64], model [96, 64]" in err and "LOAD REPORT" not in out + err
    assert snapshot(tmp_path) == before


def test_resume_refuses_data_that_changed_since_the_run_began(files, tmp_path, capsys, one_thread):
    """plan.yaml keeps a fingerprint of the data files (names, sizes, sampled blocks); --resume reads the same data
    or is one line, as for the weights; the same data resumes."""
    import shutil

    data = tmp_path / "alpaca.json"
    shutil.copy(files / "alpaca.json", data)
    path = recipe(tmp_path, GPT2)
    args = ("--micro-batch-max", "4", "--device", "cpu")
    code, out, err = cli(capsys, "run", path, "--weights", files / "tiny-gpt2", "--data", data, "--out",
                         tmp_path / "run", "--max-steps", "1", *args)
    assert code == 0, err
    saved = yaml.safe_load((tmp_path / "run" / "plan.yaml").read_text())["data_fingerprint"]
    assert saved.startswith("sha256:")
    records = json.loads(data.read_text())
    data.write_text(json.dumps([{**records[0], "output": records[0]["output"] + "!"}, *records[1:]], indent=1) + "\n")
    before = snapshot(tmp_path / "run")
    code, out, err = cli(capsys, "run", tmp_path / "run" / "plan.yaml", "--out", tmp_path / "run", "--resume", *args)
    assert code == 2 and err.startswith(f"error: --resume: the data {data} changed since the run in {tmp_path / 'run'} "
                                        f"started (fingerprint {saved} in its plan.yaml, sha256:"), err
    assert snapshot(tmp_path / "run") == before
    shutil.copy(files / "alpaca.json", data)  # the same content again
    code, out, err = cli(capsys, "run", tmp_path / "run" / "plan.yaml", "--out", tmp_path / "run", "--resume", *args)
    assert code == 0, err


def test_eval_fraction_holds_a_share_out(files, tmp_path, capsys, one_thread):
    """data.eval_fraction: the share of the training file's examples held out (rounded), drawn as eval_size draws
    that many; not with eval_size or eval_path; a share that leaves nothing to train on is one line."""
    from reproduce.data import Datasets, build_data
    from reproduce.plan.recipe import parse_recipe

    def built(**held) -> Datasets:
        body = yaml.safe_load(open(recipe(tmp_path, GPT2, **held)))
        body["data"].update({"path": str(files / "alpaca.json"), "available": True,
                             "tokenizer": str(files / "tokenizer")})
        return build_data(parse_recipe(body))

    share, count = built(eval_fraction=0.25), built(eval_size=6)  # 24 examples: a quarter is 6
    assert (len(share.train), len(share.eval)) == (18, 6)
    assert [share.eval.sequence(i) for i in range(6)] == [count.eval.sequence(i) for i in range(6)]
    code, out, err = cli(capsys, "plan", recipe(tmp_path, GPT2, eval_fraction=0.25, eval_size=6), "--micro-batch-max",
                         "4")
    assert code == 2 and "eval_fraction: give eval_size (examples) or eval_fraction (a share), not both" in err
    code, out, err = cli(capsys, "plan", recipe(tmp_path, GPT2, eval_fraction=1.5), "--micro-batch-max", "4")
    assert code == 2 and "data.eval_fraction: must be < 1" in err
    code, out, err = cli(capsys, "run", recipe(tmp_path, GPT2, eval_fraction=0.99), "--weights", files / "tiny-gpt2",
                         "--data", files / "alpaca.json", "--out", tmp_path / "run", "--micro-batch-max", "4",
                         "--device", "cpu")
    assert (code, err) == (2, f"error: data.eval_fraction: 24 examples held out of {files / 'alpaca.json'}, which "
                              "has 24: none would be left to train on\n")
