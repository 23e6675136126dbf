"""TOG's five recipes and OSFD at their defaults on 16 shapes test images, white-box (the target is the
surrogate): ``python benchmarks/detection_tog_osfd.py fcos frcnn``. Each recipe's own metric (vanishing: AP_loc;
untargeted: mAP; mislabel: CSR; fabrication: detections per image; OSFD: mAP) and seconds. TOG runs on both
surrogates; OSFD on the FCOS only (its bound-only test)."""
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

METRIC = {"tog_vanishing": "ap_loc", "tog_untargeted": "map", "tog_mislabel_ml": "csr", "tog_mislabel_ll": "csr",
          "tog_fabrication": "n_det", "osfd": "map"}
data = shapes(None, n=16)
for kind in sys.argv[1:]:
    model = build_model({"fcos": "shapes_fcos", "frcnn": "shapes_frcnn"}[kind])
    for attack, m in METRIC.items():
        if attack == "osfd" and kind != "fcos":
            continue
        t0 = time.time()
        recs, s, _ = run_recipe(attack, model, data, slots=16)
        p = s["per_target"]["m"]
        res = {f"clean_{m}": round(p[f"clean_{m}"], 4), f"adv_{m}": round(p[f"adv_{m}"], 4),
               "drop_map": round(p["drop_map"], 4), "max_linf_255": round(255 * max(r["linf"] for r in recs), 2),
               "seconds": round(time.time() - t0, 1)}
        if m != "n_det":
            res[f"drop_{m}"] = round(p[f"drop_{m}"], 4)
        print(kind, attack, json.dumps(res), flush=True)
