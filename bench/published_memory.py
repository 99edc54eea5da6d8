"""The estimate against published measured peaks: each row a named configuration on a named GPU, the source's figure
and metric, `reproduce memory`'s figure of the same metric for the same configuration, and their ratio, without and
with the estimate's allowance for what a CUDA step allocates beyond the tensors operators return (probe/gpu_like.py,
UNSEEN_ACTIVATIONS: "before" is the same estimate with it set to 0).

    PYTHONPATH=src:bench python bench/published_memory.py        # about 8 minutes on 2 busy CPU cores
    PYTHONPATH=src:bench python bench/published_memory.py Llama  # the rows whose name holds "Llama"

Rows (each source read for this benchmark):
- Hugging Face transformers docs, "Model training anatomy" (docs/source/en/model_memory_anatomy.md) and "Methods and
  tools for efficient training on a single GPU" (perf_train_gpu_one.md, the v4.2x versions that printed these):
  bert-large-uncased, sequence classification (2 labels), 512 dummy sequences of 512 tokens, Trainer defaults (fp32,
  AdamW, max_grad_norm 1.0), a 16 GB V100. The figure is `nvidia-smi`'s used memory (pynvml, MiB) after training,
  which includes the CUDA context and kernels the page measured first: 1343 MiB. Our driver-level figure is therefore
  taken with that context (not the 512 MiB allowance `reproduce memory` states for an unknown card).
- MMSegmentation's configs/deeplabv3/README.md (open-mmlab/mmsegmentation @ 94f9cb4), Cityscapes table, "Mem (GB)":
  mmcv's TextLoggerHook logs `torch.cuda.max_memory_allocated()` in MiB (the most over the ranks,
  mmcv/runner/hooks/logger/text.py), read here as GiB = MiB / 1024. DeepLabV3 R-50-D8 (ResNetV1c: the deep stem)
  and R-50b-D8 (ResNetV1b: torchvision's 7x7 stem), both with MMSeg's ASPPHead and auxiliary FCNHead
  (bench/published_factories.py:mmseg_deeplabv3), 2 crops a GPU (4xb2), fp32, SGD with momentum, SyncBN, 19
  classes; V100 GPUs (the README's timings). The config sets cudnn_benchmark=True (configs/_base_/default_runtime.py):
  cuDNN tries its algorithms with workspaces up to the free memory, and the workspace it keeps is allocated through
  PyTorch's allocator, so it is in these figures.
- torchtune's README (pytorch/torchtune @ bd2a0fc, "Optimization flags"): Llama 3.2 3B, full_finetune_single_device,
  batch 2, max sequence length 4096, bf16, an A100, "Peak Memory Active (GiB)" (`active_bytes.all.peak`: what
  PyTorch's allocator hands out, as allocated), each technique added on top of the previous one. Expressed: the
  "+ Packed Dataset" row (60.0 GiB): 2 x 4096 tokens a step, as packing makes every row full; Llama 3.2 3B's
  config.json figures on the built-in llama-7b (3072 wide, 28 layers, 24 heads, 8 KV heads, MLP 8192, vocabulary
  128256, tied embeddings), bf16 weights and AdamW (torch.optim, fused: torchtune's configs of then [U]); the packed
  rows' block-causal attention (flex attention, which keeps what flash keeps) as causal flash attention. Not
  expressed: the baseline (25.5 GiB: unpacked, each batch padded to its own longest Alpaca sample: the lengths are the
  data's), and every row after "+ Compile" (51.0, 42.9, 24.9, 23.1, 21.8, 17.6; LoRA 8.5 and QLoRA 4.6 too): they
  run under torch.compile, whose fused kernels keep other intermediates than eager ops (the estimate runs eager);
  from "+ Fuse optimizer step into backward" on, the optimizer also steps inside backward, which this tool refuses
  (not exact with accumulation).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MiB = 2**20
HF_CONTEXT = 1343 * MiB  # "GPU memory occupied: 1343 MB" after torch.ones((1, 1)).to("cuda"), on the same V100
BERT = """\
batch: {{effective: 4, devices: 1, per_device: {per_device}}}
task: classification
model: {{factory: "published_factories:bert_large_classifier", activation_checkpointing: {checkpointing}}}
data: {{factory: "published_factories:dummy_tokens"}}
optimizer: {{name: adamw, lr: 5.0e-5, weight_decay: 0.0, implementation: for-loop}}
clip_grad_norm: 1.0
schedule: {{total: {{steps: 100}}}}
"""
MMSEG = """\
batch: {{effective: 8, devices: 4, per_device: 2}}
task: segmentation
model: {{factory: "published_factories:mmseg_deeplabv3", kwargs: {{stem: {stem}, heads: mmseg}}, batchnorm: sync,
        aux_weight: 0.4, norm_layers: [batchnorm]}}
data: {{name: cityscapes, format: segmentation, layout: cityscapes, available: false, train_size: 2975, classes: 19,
       crop: [{height}, {width}], pad: true, loss_pixels: all}}
optimizer: {{name: sgd, lr: 0.01, momentum: 0.9, weight_decay: 5.0e-4}}
schedule: {{total: {{steps: 40000}}}}
"""
TORCHTUNE = """\
batch: {effective: 2, devices: 1, per_device: 2, sequence_length: 4096}
task: language-modeling
model: {builtin: llama-7b, dtype: bf16, norm_layers: [rmsnorm], kwargs: {vocab_size: 128256, hidden_size: 3072,
        intermediate_size: 8192, num_hidden_layers: 28, num_attention_heads: 24, num_key_value_heads: 8,
        max_position_embeddings: 131072, rms_norm_eps: 1.0e-5, tie_word_embeddings: true}}
data: {name: alpaca-cleaned (packed), available: false}
optimizer: {name: adamw, lr: 2.0e-5, weight_decay: 0.01, implementation: fused}
precision: bf16
schedule: {total: {steps: 100}}
"""
# (what, source, metric, published MiB, recipe, micro-batch, GPU)
ROWS = [
    ("bert-large fp32, batch 4", "HF docs", "driver", 14949,
     BERT.format(per_device=4, checkpointing="false"), 4, "v100-16gb"),
    ("bert-large fp32, batch 1 x 4 accumulation", "HF docs", "driver", 8681,
     BERT.format(per_device=4, checkpointing="false"), 1, "v100-16gb"),
    ("bert-large fp32, 1 x 4 accumulation, gradient checkpointing", "HF docs", "driver", 6775,
     BERT.format(per_device=4, checkpointing="true"), 1, "v100-16gb"),
    ("DeepLabV3 R-50-D8 (V1c) 512x1024, 2 a GPU", "MMSeg README", "allocated", round(6.1 * 1024),
     MMSEG.format(stem="v1c", height=512, width=1024), 2, "v100-32gb"),
    ("DeepLabV3 R-50b-D8 (V1b) 512x1024, 2 a GPU", "MMSeg README", "allocated", round(6.0 * 1024),
     MMSEG.format(stem="torchvision", height=512, width=1024), 2, "v100-32gb"),
    ("DeepLabV3 R-50-D8 (V1c) 769x769, 2 a GPU", "MMSeg README", "allocated", round(6.9 * 1024),
     MMSEG.format(stem="v1c", height=769, width=769), 2, "v100-32gb"),
    ("DeepLabV3 R-50b-D8 (V1b) 769x769, 2 a GPU", "MMSeg README", "allocated", round(6.8 * 1024),
     MMSEG.format(stem="torchvision", height=769, width=769), 2, "v100-32gb"),
    ("Llama 3.2 3B full bf16, 2 x 4096 packed tokens", "torchtune README", "active", round(60.0 * 1024),
     TORCHTUNE, 2, "a100-80gb"),
]
# `reproduce memory` in a child process, the allowance set first (0: the estimate without it)
CHILD = ("import runpy, sys; import reproduce.probe.fake_step as f; f.UNSEEN_ACTIVATIONS = float(sys.argv[1]); "
         "sys.argv = ['reproduce', *sys.argv[2:]]; runpy.run_module('reproduce', run_name='__main__')")


def ours(recipe: Path, micro: int, gpu: str, metric: str, allowance: float | None) -> dict:
    from reproduce.probe.gpu_like import UNSEEN_ACTIVATIONS

    out = subprocess.run([sys.executable, "-c", CHILD, str(UNSEEN_ACTIVATIONS if allowance is None else allowance),
                          "memory", str(recipe), "--micro-batch", str(micro), "--gpu", gpu, "--json"],
                         capture_output=True, text=True, check=True).stdout
    answer = json.loads(out)
    figure = answer["reserved_bytes"] + HF_CONTEXT if metric == "driver" else answer["allocated_bytes"]
    return {"figure": figure / MiB, "allocated": answer["allocated_bytes"] / MiB, "stage": answer["peak_stage"]}


def main() -> None:
    from reproduce.probe.gpu_like import UNSEEN_ACTIVATIONS

    only = sys.argv[1:]  # rows whose name holds one of these (all rows without)

    print(f"| configuration | source, metric | published MiB | estimate before | ratio | estimate with the "
          f"{UNSEEN_ACTIVATIONS:.0%} allowance | ratio | peak in |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as folder:
        for what, source, metric, published, text, micro, gpu in ROWS:
            if only and not any(word in what for word in only):
                continue
            recipe = Path(folder) / "published.yaml"
            recipe.write_text(text, encoding="utf-8")
            before, after = ours(recipe, micro, gpu, metric, 0.0), ours(recipe, micro, gpu, metric, None)
            print(f"| {what} | {source}, {metric} | {published} | {before['figure']:.0f} | "
                  f"{before['figure'] / published:.3f} | {after['figure']:.0f} | {after['figure'] / published:.3f} | "
                  f"{after['stage']} |", flush=True)


if __name__ == "__main__":
    main()
