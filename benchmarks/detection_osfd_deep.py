"""OSFD on deeper and pretrained tiny backbones (issue 13): ``shapes_fcos_deep`` (a small ResNet body, 13
convolutions, trained from scratch) and ``shapes_fcos_r20`` (the pretrained CIFAR-10 ResNet-20's body, fine-tuned;
needs the data root) against ``shapes_fcos`` (3 convolutions), on the first ``--n`` shapes test images at each
recipe's default budget. White-box OSFD, ``tog_untargeted`` and ``tog_vanishing`` (controls) on each detector, and
OSFD transferred between them. ``--models deep,fcos`` skips the pretrained one.
``BLACKBOXBENCH_DATA=... PYTHONPATH=. python benchmarks/detection_osfd_deep.py --n 48``; one line of JSON per run."""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_detection_attacks import run_recipe  # noqa: E402
from blackboxbench.detection.data import shapes  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=48)
ap.add_argument("--runs", default="white,transfer")
ap.add_argument("--models", default="deep,fcos,r20")
args = ap.parse_args()
METRIC = {"osfd": "map", "tog_untargeted": "map", "tog_vanishing": "ap_loc"}
data = shapes(None, n=args.n)
NAMES = {"deep": "shapes_fcos_deep", "fcos": "shapes_fcos", "r20": "shapes_fcos_r20"}
models = {k: build_model(NAMES[k]) for k in args.models.split(",")}
runs = []
if "white" in args.runs:
    runs += [(a, s, s) for s in models for a in METRIC]
if "transfer" in args.runs:
    runs += [("osfd", s, t) for s in models for t in models if s != t]
for attack, sur, tgt in runs:
    m = METRIC[attack]
    t0 = time.time()
    recs, s, _ = run_recipe(attack, models[sur], data, slots=16, target=models[tgt])
    p = s["per_target"]["m"]
    res = {"attack": attack, "surrogate": sur, "target": tgt, "n": args.n, f"clean_{m}": round(p[f"clean_{m}"], 4),
           f"adv_{m}": round(p[f"adv_{m}"], 4), f"drop_{m}": round(p[f"drop_{m}"], 4),
           "drop_map": round(p["drop_map"], 4), "clean_map": round(p["clean_map"], 4),
           "max_linf_255": round(255 * max(r["linf"] for r in recs), 2), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(res), flush=True)
