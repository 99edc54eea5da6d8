"""The model a run trained against its adapter on transformers' own base: python compare.py RUN_DIR BASE_FOLDER.

The trained model is rebuilt as reproduce built it (RUN_DIR/plan.yaml's recipe, RUN_DIR/model.pt). The reference is
what a user of transformers and peft loads: AutoModelForCausalLM.from_pretrained(BASE_FOLDER, dtype=model.dtype,
quantization_config=the recipe's BitsAndBytesConfig), prepared as Alpaca-LoRA and QLoRA prepare their base
(peft's prepare_model_for_kbit_training) when the recipe quantises it, with RUN_DIR/adapter put on it by
PeftModel.from_pretrained. Prints the largest difference of their logits on 300 tokens.
"""

import sys
import warnings

import peft
import torch
import yaml
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from reproduce.models import build_model
from reproduce.models.quantize import quantization_config
from reproduce.models.weights import TORCH_DTYPES
from reproduce.plan.recipe import parse_recipe

logging.disable_progress_bar()
warnings.simplefilter("ignore")

run, base_folder = sys.argv[1], sys.argv[2]
recipe = parse_recipe(yaml.safe_load(open(f"{run}/plan.yaml"))["recipe"])
trained = build_model(recipe)  # the run's model: the folder's weights, quantised, with the adapters
trained.load_state_dict(torch.load(f"{run}/model.pt", weights_only=True))
extra = {"quantization_config": quantization_config(recipe)} if recipe.model.quantize else {}
base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=TORCH_DTYPES[recipe.model.dtype], **extra)
if recipe.model.quantize:
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
adapted = peft.PeftModel.from_pretrained(base, f"{run}/adapter")
ids = torch.randint(0, base.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    difference = (trained.eval()(ids) - adapted.eval()(input_ids=ids).logits).abs().max().item()
print(f"trained model vs adapter/ on transformers' {recipe.model.quantize or recipe.model.dtype} base: largest logit "
      f"difference on 300 tokens {difference}")
