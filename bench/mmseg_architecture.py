"""MMSegmentation's DeepLabV3 R-50-D8 against the torchvision model the shipped recipe builds.

papers/mmseg-deeplabv3-r50-4xb2-cityscapes.yaml builds torchvision's DeepLabV3 ResNet-50 at output stride 8 (the
7x7 stem, DeepLabHead's 256-channel ASPP, FCNHead on layer3); MMSeg's R-50-D8 is ResNetV1c (three 3x3 stem
convolutions) with MMSeg's ASPPHead (512-channel branches and a 3x3 bottleneck after the concatenation) and FCNHead.
This prints, for 2 crops of 512 x 1024 (the config's 4xb2) on a V100 32GB, the estimate meter's allocated peak (what
MMSeg's "Mem (GB)" measures) of the shipped model and of the same network with MMSeg's stem and heads, assembled from
torchvision and torch.nn parts (bench/published_factories.py:mmseg_deeplabv3; not a built-in), and MMSeg's own
published figures. The accuracy side is MMSeg's own: R-50-D8 (V1c) against R-50b-D8 (V1b, the 7x7 stem), same heads.

    PYTHONPATH=src:bench python bench/mmseg_architecture.py      # about 2 minutes on 2 busy CPU cores
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from published_memory import MMSEG

GiB = 2**30
SHIPPED = "papers/mmseg-deeplabv3-r50-4xb2-cityscapes.yaml"
FACTORY = MMSEG.replace("heads: mmseg", "heads: {heads}")
ROWS = [  # (what, recipe text or None for the shipped recipe, MMSeg's published Mem (GB) of the same network)
    ("shipped: torchvision DeepLabV3 (7x7 stem, DeepLabHead, FCNHead)", None, None),
    ("the same, assembled here (7x7 stem, torchvision heads)", FACTORY.format(stem="torchvision", heads="torchvision",
                                                                            height=512, width=1024), None),
    ("R-50b-D8: 7x7 stem, MMSeg's ASPPHead and FCNHead", FACTORY.format(stem="torchvision", heads="mmseg",
                                                                       height=512, width=1024), 6.0),
    ("R-50-D8: ResNetV1c deep stem, MMSeg's heads (the config's)", FACTORY.format(stem="v1c", heads="mmseg",
                                                                                height=512, width=1024), 6.1),
]


def main() -> None:
    print("| model (2 crops of 512 x 1024, fp32, V100 32GB) | parameters | activations GiB | allocated GiB | "
          "MMSeg's Mem (GB) |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        for what, text, published in ROWS:
            recipe = SHIPPED
            if text is not None:
                recipe = str(Path(folder) / "mmseg.yaml")
                Path(recipe).write_text(text, encoding="utf-8")
            answer = json.loads(subprocess.run(
                [sys.executable, "-m", "reproduce", "memory", recipe, "--micro-batch", "2", "--gpu", "v100-32gb",
                 "--json"], capture_output=True, text=True, check=True).stdout)
            parameters = answer["weights_form"].split(" parameters")[0]
            print(f"| {what} | {parameters} | {answer['held']['activations'] / GiB:.2f} | "
                  f"{answer['allocated_bytes'] / GiB:.2f} | {published if published else '-'} |", flush=True)


if __name__ == "__main__":
    main()
