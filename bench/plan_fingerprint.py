"""A fingerprint of every plan: the plan as `plan --json` shows it (`cli.plan.plan_summary`, without the probe),
the LR of sampled steps, each sampled step's window of sample indices (its md5), epoch and batch, for every recipe in
papers/ and reproduce/ x micro-batch (1, 3, 16, 64, 256) x world size (1, 2, 8) x dataset size (the recipe's, 5000,
1,281,167). Written to compare two versions of the code that must plan and run alike (a refactor): run it on both
and diff the JSON files. The flat `plan --json` view, not the Plan's own fields, so that a change to how the Plan
is composed inside can be compared with the code before it.

    PYTHONPATH=src python bench/plan_fingerprint.py /tmp/before.json     # about 2 minutes here
    git switch other-version; PYTHONPATH=src python bench/plan_fingerprint.py /tmp/after.json
    python -c "import json; a, b = (json.load(open(f)) for f in ('/tmp/before.json', '/tmp/after.json')); \
               print(sum(a[k] != b.get(k) for k in a), 'of', len(a), 'differ')"
"""
import glob
import hashlib
import json
import sys

import torch

from reproduce.cli.plan import plan_summary
from reproduce.errors import UserError
from reproduce.plan.planner import lr_at, make_plan
from reproduce.plan.recipe import load_recipe
from reproduce.train import windows as W

out = {}
recipes = sorted(glob.glob("papers/*.yaml")) + sorted(glob.glob("reproduce/*.yaml"))
for path in recipes:
    try:
        r = load_recipe(path)
    except UserError:
        continue
    for micro in (1, 3, 16, 64, 256):
        for world in (1, 2, 8):
            for size in (None, 5000, 1_281_167):
                key = f"{path}|{micro}|{world}|{size}"
                try:
                    p = make_plan(r, micro, world, dataset_size=size)
                except UserError as e:
                    out[key] = "error: " + str(e)
                    continue
                d = plan_summary(p)
                total = p.optimizer_steps or 0
                steps = sorted({0, 1, total // 3, total // 2, max(0, total - 1), 7, 100, 1000} )
                steps = [s for s in steps if s < total]
                d["lr"] = [repr(lr_at(p, s)) for s in steps]
                win = []
                if p.dataset_size and p.steps_per_epoch:
                    for s in steps[:6]:
                        try:
                            idx, partial = W.window(p, p.dataset_size, s, seed=3, rank=world - 1)
                            digest = hashlib.md5(torch.cat(idx).numpy().tobytes()).hexdigest()
                            win.append([digest, [len(i) for i in idx][:5], partial, repr(W.step_epoch(p, s)),
                                        str(W.step_batch(p, s))])
                        except UserError as e:
                            win.append("error " + str(e))
                d["windows"] = win
                out[key] = d
json.dump(out, open(sys.argv[1], "w"), indent=0, sort_keys=True)
print(len(out))
