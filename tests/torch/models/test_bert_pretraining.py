"""BERT pre-training: the model with both heads (masked LM + next sentence, pooler), sentence pairs built from local
text as BERT's create_pretraining_data.py builds them, and the loss over a window of micro-batches equal to
transformers' own BertForPreTraining loss over the whole batch (a plain loop), in float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from factories import NUMBERED_VOCAB, numbered_documents
from helpers import assert_same_weights, run_accumulated
from reproduce.data import build_data
from reproduce.data.batches import fetch
from reproduce.data.pairs import BYTES, SentencePairs, Vocabulary
from reproduce.models import LOSSES, MODELS, build_model, count_parameters
from reproduce.plan.recipe import load_recipe, parse_recipe

PAPERS = Path(__file__).resolve().parents[3] / "papers"
TINY_BERT = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
             "max_position_embeddings": 64, "vocab_size": 2100, "pad_token_id": 2000, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0}


def bert_recipe(steps: int = 3, custom: bool = False, **batch) -> dict:
    """Task language-modeling takes the model's own loss (bert-mlm-nsp); `custom` names it: task custom, loss."""
    task = {"task": "custom", "loss": {"builtin": "bert-mlm-nsp"}} if custom else {"task": "language-modeling"}
    return {
        "batch": {"effective": 16, "sequence_length": 32, **batch}, **task,
        "model": {"builtin": "bert-base", "kwargs": TINY_BERT},
        "data": {"factory": "factories:bert_pairs", "shuffle": False},
        "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.01}, "schedule": {"total": {"steps": steps}},
    }


@pytest.mark.parametrize("name", ["devlin2019-bert-base", "you2019-lamb-bert-large", "pysource-bert"])
def test_language_modeling_with_a_bert_model_takes_its_pretraining_loss(name):
    from reproduce.train.losses import TokenLoss, build_loss
    from reproduce.train.pretraining_loss import MaskedLMNextSentenceLoss

    recipe = load_recipe(PAPERS / f"{name}.yaml")
    assert recipe.task == "language-modeling" and recipe.loss is None
    assert isinstance(build_loss(recipe).function, MaskedLMNextSentenceLoss)
    assert isinstance(build_loss(load_recipe(PAPERS / "pysource-gpt.yaml")), TokenLoss)
    assert isinstance(build_loss(parse_recipe(bert_recipe(custom=True))).function, MaskedLMNextSentenceLoss)


def test_bert_base_has_both_pretraining_heads_and_bert_large_is_336m():
    with torch.device("meta"):
        base, large = MODELS["bert-base"](), MODELS["bert-large"]()
    heads = dict(base.model.cls.named_parameters())
    assert "predictions.transform.dense.weight" in heads and "seq_relationship.weight" in heads
    assert heads["seq_relationship.weight"].shape == (2, 768) and base.model.bert.pooler is not None
    assert base.model.cls.predictions.decoder.weight is base.model.bert.embeddings.word_embeddings.weight  # tied
    assert abs(count_parameters(base)[0] - 110e6) <= 0.01 * 110e6  # Devlin et al. sec. 3: 110M
    assert abs(count_parameters(large)[0] - 336e6) <= 0.01 * 336e6  # bert-large-uncased's card: 336M
    assert load_recipe(PAPERS / "you2019-lamb-bert-large.yaml").model.builtin == "bert-large"


def test_papers_labels_lamb_bert_large(capsys, monkeypatch, tmp_path):
    from reproduce.cli import main

    monkeypatch.setenv("REPRODUCE_CACHE_DIR", str(tmp_path))
    with pytest.raises(SystemExit):
        main(["papers", "--dir", str(PAPERS)])
    row = next(line for line in capsys.readouterr().out.splitlines() if "you2019-lamb-bert-large" in line)
    assert "bert-large 336.2M" in row


def test_pairs_are_berts_layout_with_next_sentence_labels_and_masks():
    vocab = Vocabulary(**NUMBERED_VOCAB)
    pairs = SentencePairs(numbered_documents(), 24, vocab, seed=3, dupe_factor=4)
    assert len(pairs) > 20
    seen = set()
    for row in range(len(pairs)):
        inputs, target = pairs[row]
        ids, types, mask = inputs["input_ids"], inputs["token_type_ids"], inputs["attention_mask"]
        length = int(mask.sum())
        labels, next_label = target[:-1], int(target[-1])
        assert (ids[length:] == vocab.pad).all() and (labels[length:] == -100).all() and length <= 24
        original = torch.where(labels != -100, labels, ids)[:length].tolist()
        assert original[0] == vocab.cls and original[-1] == vocab.sep and original.count(vocab.sep) == 2
        first_sep = original.index(vocab.sep)
        a, b = original[1:first_sep], original[first_sep + 1:-1]
        assert types[:first_sep + 1].eq(0).all() and types[first_sep + 1:length].eq(1).all()
        masked = int((labels != -100).sum())
        assert masked == min(4, max(1, round(length * 0.15)))  # ceil(0.15 x 24) = 4 at most
        assert not ((labels != -100) & ((ids == vocab.cls) | (ids == vocab.sep) | (ids == vocab.pad))).any()
        assert a and b
        same_document = a[-1] // 100 == b[0] // 100
        assert a == sorted(a) and b == sorted(b)  # spans of a document in its order (cut at the front or back)
        if next_label == 0:  # IsNext: B continues A's document, after A's last sentence
            assert same_document and b[0] // 10 > a[-1] // 10
        else:  # NotNext: B from another document
            assert not same_document
        seen.add(next_label)
    assert seen == {0, 1}


def test_window_loss_equals_transformers_loss_over_the_whole_batch_float64(tmp_path):
    """Micro-batches of 4 (masked tokens differ between them) accumulated over the window of 16 give the weights a
    plain loop gets from BertForPreTraining(labels=..., next_sentence_label=...).loss: mean masked-LM + mean NSP."""
    recipe = bert_recipe()
    plan, summary, ours, data = run_accumulated(recipe, micro_batch=4, tmp_path=tmp_path)
    assert plan.accumulation_steps == 4
    parsed = parse_recipe(recipe)
    torch.manual_seed(parsed.seed)
    model = build_model(parsed, data.info).to(torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    counts = []
    for step in range(3):
        inputs, target = fetch(data.train, torch.arange(step * 16, (step + 1) * 16))
        output = model.model(**inputs, labels=target[:, :-1].contiguous(), next_sentence_label=target[:, -1])
        counts.append([int((target[i:i + 4, :-1] != -100).sum()) for i in range(0, 16, 4)])
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
    assert any(len(set(window)) > 1 for window in counts)  # micro-batches hold different numbers of masked tokens
    assert_same_weights(ours, model.state_dict(), rtol=1e-6, atol=1e-12)
    assert summary["final"]["items"] == sum(counts[-1])  # the loop normalised by the window's masked tokens


def test_the_mean_of_micro_batch_losses_would_differ():
    """The point of the window counts: averaging each micro-batch's own (MLM mean + NSP mean) is not the batch's."""
    data = build_data(parse_recipe(bert_recipe()))
    loss = LOSSES["bert-mlm-nsp"]()
    torch.manual_seed(0)
    mlm, nsp = torch.randn(16, 32, 2100, dtype=torch.float64), torch.randn(16, 2, dtype=torch.float64)
    _, target = fetch(data.train, torch.arange(16))
    parts = [target[i:i + 4] for i in range(0, 16, 4)]
    counts = [loss.count(part) for part in parts]
    loss.window(sum(counts), 16)
    window = sum(loss((mlm[i:i + 4], nsp[i:i + 4]), parts[i // 4]) for i in range(0, 16, 4)) / sum(counts)
    whole = (torch.nn.functional.cross_entropy(mlm.flatten(0, 1), target[:, :-1].flatten(), ignore_index=-100)
             + torch.nn.functional.cross_entropy(nsp, target[:, -1]))
    torch.testing.assert_close(window, whole)
    separate = sum(LOSSES["bert-mlm-nsp"]()((mlm[i:i + 4], nsp[i:i + 4]), parts[i // 4]) / counts[i // 4]
                   for i in range(0, 16, 4)) / 4
    assert abs(float(separate - whole)) > 1e-6


def test_phases_cut_the_pairs_at_each_length(tmp_path):
    """BERT's 128-then-512 in miniature: one step at 16 tokens, then 32; the data made again at each length."""
    from reproduce.data import training_sizes
    from reproduce.plan.planner import make_plan
    from reproduce.train.trainer import RunRequest, train

    recipe = parse_recipe(bert_recipe(steps=2, phases=[{"steps": 1, "effective": 16, "sequence_length": 16},
                                                       {"effective": 16}]))
    data = build_data(recipe)
    plan = make_plan(recipe, micro_batch_max=8, dataset_size=training_sizes(recipe, data.train))
    summary = train(plan, RunRequest(tmp_path / "run", device="cpu"), dtype=torch.float64, data=data)
    weights = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert [(p.sequence_length, p.accumulation_steps) for p in plan.segments] == [(16, 2), (32, 2)]
    assert summary["steps"] == 2 and all(torch.isfinite(w).all() for w in weights.values())


def test_the_estimate_runs_bert_pretraining_on_fake_tensors():
    from reproduce.hardware.catalog import lookup
    from reproduce.probe.meters import EstimateMeter
    from reproduce.probe.workload import Workload

    recipe = parse_recipe({**bert_recipe(), "data": {"name": "bookscorpus", "available": False}})
    workload = Workload(recipe)
    inputs, target = workload.batch(2)
    assert set(inputs) == {"input_ids", "token_type_ids", "attention_mask"} and target.shape == (2, 33)
    gpu = lookup("a100-40gb")
    trial = EstimateMeter(workload, gpu.budget_bytes, 0.0, gpu=gpu, cap=16).measure(4)
    assert trial.fits and trial.peak_bytes > 0


def test_pysource_pairs_is_a_builtin_corpus_of_pairs():
    data = build_data(parse_recipe({**bert_recipe(), "model": {"builtin": "bert-base", "kwargs": {
        **TINY_BERT, "vocab_size": BYTES.size, "pad_token_id": BYTES.pad}},
        "data": {"builtin": "pysource-pairs", "kwargs": {"max_bytes": 60_000}}}))
    train = data.train
    assert data.info["vocab_size"] == 260 and len(train) > 100 and train.length == 32
    inputs, target = fetch(train, torch.arange(len(train)))
    assert int(inputs["input_ids"].max()) < 260 and set(target[:, -1].tolist()) == {0, 1}
    assert (inputs["input_ids"][:, 0] == BYTES.cls).all()


def wordpiece_folder(folder: Path, lines: list[str]) -> Path:
    """A small BERT-style WordPiece tokenizer trained here on `lines` (nothing downloaded), saved for AutoTokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(lines, trainer=trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials,
                                                                           show_progress=False))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                      cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    wrapped.save_pretrained(str(folder))
    return folder


def test_text_pairs_reads_berts_layout_with_a_local_tokenizer(tmp_path):
    """One sentence per line, a blank line between documents (create_pretraining_data.py's input)."""
    from transformers import AutoTokenizer

    from reproduce.errors import UserError

    sentences = [f"document {d} says sentence number {s} about topic {d * s % 7}." for d in range(8) for s in range(6)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join("\n".join(sentences[d * 6:(d + 1) * 6]) for d in range(8)) + "\n")
    folder = wordpiece_folder(tmp_path / "tokenizer", sentences)
    recipe = parse_recipe({**bert_recipe(), "data": {"builtin": "text-pairs", "kwargs": {
        "path": str(corpus), "tokenizer": str(folder), "dupe_factor": 3}}})
    data = build_data(recipe)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    train = data.train
    assert data.info["documents"] == 8 and data.info["vocab_size"] == len(tokenizer) and len(train) > 8
    assert train.length == 32 and (train.input_ids[:, 0] == tokenizer.cls_token_id).all()
    inputs, target = fetch(train, torch.arange(len(train)))
    restored = torch.where(target[:, :-1] != -100, target[:, :-1], inputs["input_ids"])
    first = tokenizer.decode(restored[0][inputs["attention_mask"][0].bool()])
    assert first.startswith("[CLS] document") and first.count("[SEP]") == 2
    assert set(target[:, -1].tolist()) == {0, 1}
    missing = parse_recipe({**bert_recipe(), "data": {"builtin": "text-pairs", "kwargs": {
        "path": str(tmp_path / "nothing.txt"), "tokenizer": str(folder)}}})
    with pytest.raises(UserError, match=r"data.kwargs.path: .*nothing.txt: no such file \(expected text: one sentence"):
        build_data(missing)


@pytest.mark.parametrize("chunk", [None, 8])
def test_verify_finds_the_window_gradient_equal_to_one_pass(chunk):
    """`reproduce verify`'s check on BERT pre-training: micro-batches of 4 against one pass (or chunks of 8), the
    reference normalising each term over the whole batch's own count too."""
    from reproduce.plan.planner import make_plan
    from reproduce.verify.accumulation import verify

    recipe = parse_recipe(bert_recipe(custom=True))  # the loss named: task custom
    data = build_data(recipe)
    result = verify(make_plan(recipe, 4, dataset_size=len(data.train)), data=data, chunk=chunk)
    assert result.equivalent and result.global_relative_error < 1e-12 and result.micro_batches == 4


@pytest.mark.slow
def test_two_processes_equal_one_with_the_window_counts_summed_over_ranks(tmp_path):
    """DDP over two processes (gloo): each rank's micro-batches hold other numbers of masked tokens, and the loss's
    two terms are normalised by the counts summed over both ranks, so the run equals one process accumulating."""
    from helpers import assert_close_weights, reproduce_run, reproduce_run_here, weights

    recipe = bert_recipe(steps=3)
    two = reproduce_run(recipe, tmp_path, "two", "--micro-batch-max", "4", "--nproc-per-node", "2")
    assert "micro 4 x accumulation 2 x world 2 = 16" in two.stdout
    reproduce_run_here(recipe, tmp_path, "one", "--micro-batch-max", "4")
    assert_close_weights(weights(tmp_path, "two"), weights(tmp_path, "one"))
