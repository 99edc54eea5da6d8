"""Load what `reproduce run` left, as transformers and peft load it: python load.py RUN_DIR BASE_FOLDER.

RUN_DIR/adapter is peft's save_pretrained folder, put on the base folder's model; RUN_DIR/merged (`run --merged`)
is a Hugging Face folder with the adapters merged in, loaded without peft. Both give the same logits, within the
rounding of the merged weights to the recipe's model.dtype (fp16 for Alpaca-LoRA, whose base trains in 8 bits:
the adapters are merged into the base folder's fp16 weights, as its export_hf_checkpoint.py does).
"""

import sys
import warnings

import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.disable_progress_bar()
warnings.simplefilter("ignore", FutureWarning)

run, base_folder = sys.argv[1], sys.argv[2]
with safe_open(f"{run}/adapter/adapter_model.safetensors", "pt") as adapter:
    names = list(adapter.keys())
print(f"adapter: {len(names)} tensors, e.g. {names[0]}")
tokenizer = AutoTokenizer.from_pretrained(f"{run}/merged")
ids = tokenizer("### Instruction:\nName a colour.\n\n### Response:\n", return_tensors="pt").input_ids
base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float16)  # the recipe's model.dtype
adapted = PeftModel.from_pretrained(base, f"{run}/adapter")  # the base with the run's adapters on it
merged = AutoModelForCausalLM.from_pretrained(f"{run}/merged")  # the adapters merged in: no peft needed
with torch.no_grad():
    difference = (adapted(ids).logits - merged(ids).logits).abs().max().item()
print(f"merged: {merged.config.architectures[0]} in {merged.dtype}; largest logit difference from the adapter on the "
      f"base: {difference:.4f}")
