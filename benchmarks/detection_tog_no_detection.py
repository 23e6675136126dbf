"""TOG-untargeted on the tiny Faster R-CNN where it detects nothing: the shapes test images (of the first ``n``,
default 256) without a clean detection at the pseudo truth's threshold, alone and with the first 13 others (16
images), white-box. Detections per image and mAP: ``python benchmarks/detection_tog_no_detection.py [n]``."""
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_detection_attacks import _tog_ctx, run_recipe  # noqa: E402
from blackboxbench.detection.attacks import pseudo_truth  # noqa: E402
from blackboxbench.detection.data import shapes  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402

model = build_model("shapes_frcnn")
data = shapes(None, n=int(sys.argv[1]) if len(sys.argv) > 1 else 256)
empty = []
for i in range(0, len(data.y), 32):
    truth = pseudo_truth(_tog_ctx(model, data.x[i:i + 32]), 0.2)
    empty += [i + j for j, t in enumerate(truth) if not len(t["labels"])]
print(f"{len(empty)} of {len(data.y)} images without a clean detection: {empty}")
others = [i for i in range(len(data.y)) if i not in empty][:16 - len(empty)]
for name, idx in (("no detection", empty), ("with 13 others" if len(others) == 13 else "with others", empty + others)):
    t0 = time.time()
    _, s, _ = run_recipe("tog_untargeted", model, data.subset(idx), slots=len(idx))
    p = s["per_target"]["m"]
    print(f"{name} ({len(idx)} images): detections / image {p['clean_n_det']:.2f} -> {p['adv_n_det']:.2f}, "
          f"mAP {p['clean_map']:.4f} -> {p['adv_map']:.4f}, {time.time() - t0:.1f} s")
