"""Every shipped paper recipe against the figures its paper states: the effective batch, the length of the run, the
warm-up, the learning rate where each stretch of the schedule starts, and the parameter count.

Each row is what a careful reader takes from the paper (or the authors' code, which the recipes cite), converted
to optimizer steps where the paper counts epochs or tokens: [P] stated, [D] derived from stated figures (the
arithmetic in the comment), [S] secondary. The plan is made for the paper's own per-device batch (exact policy, so
the paper's lr). What a recipe does differently from its paper on purpose is in its `deviations:`
(tests/cli/test_deviations.py), never hidden here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from reproduce.models import build_model, count_parameters
from reproduce.plan.planner import lr_at, make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.probe.workload import synthetic_data

PAPERS = Path(__file__).resolve().parents[2] / "papers"
IMAGENET = 1_281_167  # ImageNet-1k training images


@dataclass(frozen=True)
class Figures:
    name: str
    batch: tuple[int, str]  # the paper's effective batch and its unit (samples, or tokens)
    total: int | None = None  # optimizer steps
    warmup: int | None = None  # warm-up optimizer steps
    lr: dict = field(default_factory=dict)  # optimizer step -> the lr there (start, warm-up end, phases, milestones)
    parameters: float | None = None  # the published count of what `counted` counts
    tolerance: float = 0.01  # published counts are rounded to 2-3 significant digits
    counted: str = "all"  # all, trainable, or "without PREFIX" (the paper counts the model without that part)
    decay: str | None = None  # the decay's kind
    total_tokens: float | None = None  # for a paper that counts its run in tokens (with a batch ramp)
    warmup_tokens: float | None = None
    expected_failures: dict = field(default_factory=dict)  # figure -> reason


FIGURES = [
    # Goyal et al. 2017: kn = 8192 [P]; 90 epochs [P] x 156 steps (1,281,167 // 8192) = 14,040 [D]; 5 warm-up epochs
    # = 780 [D] from 0.1 to 3.2 [P]; /10 at epochs 30, 60, 80 [P]; ResNet-50 25.6M (keras.io; the papers state FLOPs).
    Figures("goyal2017-resnet50", (8192, "samples"), total=14040, warmup=780, decay="step", parameters=25.6e6,
            lr={0: 0.1, 780: 3.2, 4680: 0.32, 9360: 0.032, 12480: 0.0032}),
    # He et al. 2016: 256 [P], "up to 60 x 10^4 iterations" [P], lr 0.1 [P] "divided by 10 when the error plateaus".
    Figures("he2016-resnet50", (256, "samples"), total=600_000, warmup=0, lr={0: 0.1}, decay="plateau",
            parameters=25.6e6),
    # You et al. 2017 (LARS), the TPU reference's figures [S]: 32K [P]; 90 epochs x 39 (1,281,167 // 32768) = 3510 [D];
    # 12 warm-up epochs = 468 [D] to lr 34 [S]; polynomial decay.
    Figures("you2017-lars-resnet50", (32768, "samples"), total=3510, warmup=468, lr={0: 0.0, 468: 34.0},
            decay="polynomial", parameters=25.6e6),
    # Devlin et al. 2019: 256 sequences [P], 1,000,000 steps [P], 10,000 warm-up steps to 1e-4 [P], linear decay
    # (to 0 at the last step) [P]: 1e-4 x 100,000 / 990,000 = 1.0101e-5 where the 512-token phase starts at 900,000
    # [D] (the repo's decay from step 0 gives 1.0e-5: a declared deviation); BERT-base 110M [P].
    Figures("devlin2019-bert-base", (256, "samples"), total=1_000_000, warmup=10_000, decay="linear",
            lr={0: 0.0, 10_000: 1e-4, 900_000: 1e-4 * 100_000 / 990_000}, parameters=110e6),
    # You et al. 2019 (LAMB): 64k then 32k [P], 8599 iterations [P]; NVIDIA's reproduction [S]: 2000 warm-up steps to
    # 6e-3, then the second phase warms up again from 0 (to 4e-3): the lr is back near 0 at its first step, 7038.
    # BERT-Large 336M (bert-large-uncased's count; the paper rounds to 340M).
    Figures("you2019-lamb-bert-large", (32768, "samples"), total=8599, warmup=2000, parameters=336e6,
            lr={0: 0.0, 2000: 6e-3, 7038: 0.0}),
    # Dosovitskiy et al. 2021: 4096 [P]; 90 epochs of ImageNet-21k's "14M images" (sec. 4.1) [P]: 90 x 3417
    # (14,000,000 // 4096) = 307,530 [D]; 10k warm-up steps to 1e-3 [P]; ViT-B 86M without its head (Table 1) [P].
    Figures("dosovitskiy2021-vit-b16", (4096, "samples"), total=307_530, warmup=10_000, lr={0: 0.0, 10_000: 1e-3},
            decay="linear", parameters=86e6, counted="without heads."),
    # Touvron et al. 2021: 1024 [P]; 300 epochs x 1251 (1,281,167 // 1024) = 375,300 [D]; 5 warm-up epochs = 6255
    # [D] from 1e-6 to 1e-3 [P]; cosine; DeiT-B 86M [P].
    Figures("touvron2021-deit-b", (1024, "samples"), total=375_300, warmup=6255, lr={0: 1e-6, 6255: 1e-3},
            decay="cosine", parameters=86e6),
    # He et al. 2022 (MAE): 4096 [P]; 800 epochs x 312 (1,281,167 // 4096) = 249,600 [D]; 40 warm-up epochs = 12,480
    # [D] to 1.5e-4 x 4096 / 256 = 2.4e-3 [P]; the ViT-L/16 encoder 304M (its decoder left out).
    Figures("he2022-mae-pretrain", (4096, "samples"), total=249_600, warmup=12_480, lr={0: 0.0, 12_480: 2.4e-3},
            decay="cosine", parameters=304e6, counted="without model.decoder."),
    # Hu et al. 2021 (LoRA): 8 [P]; 5 epochs x 5257 (42,061 // 8) = 26,285 [D]; 500 warm-up steps to 2e-4 [P];
    # trainable: 24 layers x 2 adapters x r 4 x (1024 + 1024) = 393,216 [D] (Table 3 prints 0.35M).
    Figures("hu2021-lora-gpt2m-e2e", (8, "samples"), total=26_285, warmup=500, lr={0: 0.0, 500: 2e-4},
            decay="linear", parameters=393_216, tolerance=0.0, counted="trainable"),
    # fairseq RoBERTa-base: 2048 [P], 125,000 updates [P], 10,000 warm-up to 5e-4 [P]; roberta.base 125M [P].
    Figures("liu2019-roberta-base-fairseq", (2048, "samples"), total=125_000, warmup=10_000,
            lr={0: 0.0, 10_000: 5e-4}, decay="polynomial", parameters=125e6),
    # llm.c: 524,288 tokens [P], 18,865 steps [P], 700 warm-up steps to 6e-4 [P]; train_gpt2.cu's parameter tensors
    # at the padded vocabulary 50304: 124,475,904 [D].
    Figures("llmc-gpt2-124m", (524_288, "tokens"), total=18_865, warmup=700, lr={700: 6e-4}, decay="cosine",
            parameters=124_475_904, tolerance=0.0),
    # nanoGPT GPT-2: 491,520 tokens [P], max_iters 600,000 [P], warmup_iters 2000 to 6e-4 [P]; "number of parameters:
    # 123.59M" without the 1024 x 768 position embeddings [P]: 123,587,328 + 786,432 = 124,373,760 [D].
    Figures("nanogpt-gpt2-124m", (491_520, "tokens"), total=600_000, warmup=2000, lr={2000: 6e-4}, decay="cosine",
            parameters=124_373_760, tolerance=0.0),
    # nanoGPT shakespeare-char: 64 x 256 = 16,384 tokens [P], 5000 iterations [P], 100 warm-up to 1e-3 [P];
    # "10.65M" + 256 x 384 position embeddings = 10,745,088 [D].
    Figures("nanogpt-shakespeare-char", (16_384, "tokens"), total=5000, warmup=100, lr={100: 1e-3}, decay="cosine",
            parameters=10_745_088, tolerance=0.0),
    # Stanford Alpaca: 128 [P]; 3 epochs x 407 (52,002 / 128 rounded up: the last batch kept) = 1221 [D]; warmup_ratio
    # 0.03: 37 steps [D] to 2e-5 [P]; LLaMA-7B 6.7B [P] (+ one [PAD] row).
    Figures("taori2023-alpaca-7b", (128, "samples"), total=1221, warmup=37, lr={0: 0.0, 37: 2e-5}, decay="cosine",
            parameters=6.7e9),
    # Alpaca-LoRA: 128 [P]; 3 epochs x 389 (49,760 / 128 rounded up) = 1167 [D]; 100 warm-up steps to 3e-4 [P];
    # "trainable params: 4194304" (r 8 on q_proj and v_proj of 32 layers: 32 x 2 x 8 x 8192) [P].
    Figures("tloen2023-alpaca-lora", (128, "samples"), total=1167, warmup=100, lr={0: 0.0, 100: 3e-4},
            decay="linear", parameters=4_194_304, tolerance=0.0, counted="trainable"),
    # QLoRA's Guanaco 7B (artidoro/qlora scripts/finetune_guanaco_7b.sh): 4 x 4 = 16 [P], max_steps 1875 [P], lr 2e-4
    # constant [P] (transformers' constant schedule takes no warm-up); r 64 on all 7 linear layers of 32 blocks:
    # 32 x 64 x (4 x (4096 + 4096) + 3 x (4096 + 11008)) = 159,907,840 trainable [D].
    Figures("dettmers2023-qlora-guanaco-7b", (16, "samples"), total=1875, warmup=0, lr={0: 2e-4, 1874: 2e-4},
            decay="constant", parameters=159_907_840, tolerance=0.0, counted="trainable"),
    # Touvron et al. 2023: "4M" tokens, read as 2^22 [S]; 1.0T tokens / 4,194,304 = 238,419 steps [D]; 2000 warm-up
    # steps to 3e-4 [S]; LLaMA-7B 6.7B [S].
    Figures("touvron2023-llama-7b", (4_194_304, "tokens"), total=238_419, warmup=2000, lr={0: 0.0, 2000: 3e-4},
            decay="cosine", parameters=6.7e9),
    # Brown et al. 2020: "0.5M" tokens read as 2^19 [P/D], 300B tokens [S], warm-up over 375M tokens to 6e-4 [S/P],
    # GPT-3 Small 125M [P]; the batch ramp's steps may not depend on the micro-batch.
    Figures("brown2020-gpt3-small", (524_288, "tokens"), total_tokens=300e9, warmup_tokens=375e6, decay="cosine",
            parameters=125e6),
    # Chen et al. 2017 (DeepLabV3) sec. 4.1: "batch size of 16" [P], "30K iterations" [P] at "initial learning rate =
    # 0.007" [P], "poly" (1 - iter / max_iter)^0.9 [P]: 0.007 x 0.5^0.9 = 0.0037512 at 15K [D]; no warm-up stated.
    Figures("chen2017-deeplabv3", (16, "samples"), total=30_000, warmup=0, decay="polynomial",
            lr={0: 0.007, 15_000: 0.007 * 0.5**0.9}),
    # its second stage: "another 30K iterations and smaller base learning rate = 0.001" [P], the same poly [P].
    Figures("chen2017-deeplabv3-stage2", (16, "samples"), total=30_000, warmup=0, decay="polynomial",
            lr={0: 0.001, 15_000: 0.001 * 0.5**0.9}),
    # MMSegmentation deeplabv3_r50-d8_4xb2-40k_cityscapes-512x1024: 4 x 2 [C], max_iters 40000 [C], lr 0.01 [C], PolyLR
    # power 0.9 to eta_min 1e-4 [C] (MMEngine: eta_min + (lr - eta_min) x (1 - t / T)^0.9): 0.0054053 at 20K [D].
    Figures("mmseg-deeplabv3-r50-4xb2-cityscapes", (8, "samples"), total=40_000, warmup=0, decay="polynomial",
            lr={0: 0.01, 20_000: 1e-4 + (0.01 - 1e-4) * 0.5**0.9}),
]
BY_NAME = {figures.name: figures for figures in FIGURES}


def shipped_papers() -> list[str]:
    """The papers' recipes (not the built-in demos): those that cite a paper or an authors' repository."""
    names = []
    for path in sorted(PAPERS.glob("*.yaml")):
        recipe = load_recipe(path)
        if recipe.paper and (recipe.paper.arxiv or recipe.paper.url):
            names.append(path.stem)
    return names


def case(figure: str, *, where=None) -> list:
    rows = [row for row in FIGURES if where is None or where(row)]
    return [pytest.param(row, id=row.name, marks=pytest.mark.xfail(reason=row.expected_failures[figure], strict=False))
            if figure in row.expected_failures else pytest.param(row, id=row.name) for row in rows]


def planned(row: Figures):
    recipe = load_recipe(PAPERS / f"{row.name}.yaml")
    return recipe, make_plan(recipe, micro_batch_max=recipe.batch.per_device or 16)


def test_every_shipped_paper_has_a_row():
    assert sorted(shipped_papers()) == sorted(BY_NAME)


@pytest.mark.parametrize("row", case("batch"))
def test_effective_batch(row):
    recipe, plan = planned(row)
    effective, unit = row.batch
    assert (recipe.batch.effective, recipe.batch.unit) == (effective, unit)
    assert plan.exact and plan.lr == recipe.optimizer.lr
    if unit == "tokens":
        assert plan.effective_tokens == effective


@pytest.mark.parametrize("row", case("total", where=lambda row: row.total is not None))
def test_total_steps(row):
    assert planned(row)[1].optimizer_steps == row.total


@pytest.mark.parametrize("row", case("warmup", where=lambda row: row.warmup is not None))
def test_warmup_steps(row):
    assert planned(row)[1].warmup_steps == row.warmup


@pytest.mark.parametrize("row", case("lr", where=lambda row: row.lr))
def test_lr_where_each_stretch_starts(row):
    recipe, plan = planned(row)
    phase_starts = {phase.start_step for phase in plan.segments if phase.kind == "phase"}
    assert phase_starts <= set(row.lr)  # every phase start has its figure
    for step, expected in row.lr.items():  # exactly; "near zero" (0.5% of the peak) where a warm-up starts
        near = recipe.optimizer.lr * 5e-3 if expected == 0 else 0.0
        assert lr_at(plan, step) == pytest.approx(expected, rel=1e-9, abs=near), step


@pytest.mark.parametrize("row", case("decay", where=lambda row: row.decay is not None))
def test_decay_kind(row):
    assert planned(row)[1].schedule.decay_kind == row.decay


def tokens_until(plan, steps: int) -> int:
    """The tokens the plan's first `steps` optimizer steps read, phase by phase (a ramp's batches included)."""
    total = 0
    for phase in plan.segments:
        end = min(phase.end_step if phase.end_step is not None else steps, steps)
        if end > phase.start_step:
            total += (end - phase.start_step) * phase.effective_batch * phase.sequence_length
    return total


@pytest.mark.parametrize("row", case("tokens", where=lambda row: row.total_tokens is not None))
def test_runs_counted_in_tokens(row):
    _, plan = planned(row)
    step_tokens = row.batch[0]
    assert abs(tokens_until(plan, plan.optimizer_steps) - row.total_tokens) <= step_tokens
    assert abs(tokens_until(plan, plan.warmup_steps) - row.warmup_tokens) <= step_tokens


@pytest.mark.parametrize("row", case("ramp", where=lambda row: row.total_tokens is not None))
def test_a_ramp_does_not_depend_on_the_machine(row):
    recipe = load_recipe(PAPERS / f"{row.name}.yaml")
    steps = {m: make_plan(recipe, micro_batch_max=m).optimizer_steps for m in (1, 16, 256)}
    assert len(set(steps.values())) == 1, steps


@pytest.mark.parametrize("row", case("parameters", where=lambda row: row.parameters is not None))
def test_parameter_count(row):
    recipe = load_recipe(PAPERS / f"{row.name}.yaml")
    with torch.device("meta"):
        model = build_model(recipe, synthetic_data(recipe).info)
    total, trainable = count_parameters(model)
    if row.counted == "trainable":
        counted = trainable
    elif row.counted.startswith("without "):
        prefix = row.counted.removeprefix("without ")
        counted = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(prefix))
    else:
        counted = total
    assert abs(counted - row.parameters) <= row.tolerance * row.parameters, f"{counted:,} vs {row.parameters:,.0f}"
