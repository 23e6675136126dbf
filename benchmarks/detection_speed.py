#!/usr/bin/env python
"""Seconds per image of every detection recipe on the tiny FCOS (white-box, surrogate = target) over the first
``--n`` shapes test images, with the relative drops of mAP / AP_loc / CSR and the detection ratio.

    python benchmarks/detection_speed.py --threads 2 --n 16 [--only tog_vanishing,dag]
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from blackboxbench import catalog  # noqa: E402
from blackboxbench.builder import build_attack, load_recipe  # noqa: E402
from blackboxbench.config import finish_threat, load_yaml  # noqa: E402
from blackboxbench.detection.data import shapes  # noqa: E402
from blackboxbench.detection.training import ATTACKER_ASSETS  # noqa: E402
from blackboxbench.family import RunInputs  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.registry import FAMILY  # noqa: E402
from blackboxbench.rng import Streams  # noqa: E402
from blackboxbench.runner import schedule  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, data = build_model("shapes_fcos"), shapes(None, n=args.n)
    fam = FAMILY.get("detection")
    names = [n for n, p in catalog.entries("attacks").items() if load_yaml(p)["family"] == "detection"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    print("| recipe | eps | s / image | drop mAP | drop AP_loc | drop CSR | detections adv / clean | mean Linf (x255) "
          "| mean L2 | mean SSIM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        recipe, src = load_recipe(name, "bench")
        t = finish_threat({}, recipe, fam, "bench")
        attack = build_attack(recipe, t, src)
        assets = {k: ATTACKER_ASSETS[kind](None) for k, (_, kind) in attack.meta["assets"].items()}
        run = RunInputs(attack=attack, threat=t, data=data,
                        models={"surrogates": [model], "targets": [model]},
                        model_names={"surrogates": ["m"], "targets": ["m"]}, streams=Streams(0, args.n, "cpu"),
                        device=torch.device("cpu"), slots=args.n, assets=assets, save_adv=False)
        records = []
        t0 = time.perf_counter()
        schedule(fam.worker(run), range(args.n), records.extend, lambda _: None)
        wall = (time.perf_counter() - t0) / args.n
        s = fam.summarize(records)
        p = s["per_target"]["m"]
        f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        print(f"| `{name}` | {t['norm']} {t['eps'] * (255 if t['norm'] == 'linf' else 1):.4g}"
              f"{'/255' if t['norm'] == 'linf' else ''} | {s['time_per_image']:.2f} ({wall:.2f} with evaluation) | "
              f"{f(p['drop_map'])} | {f(p['drop_ap_loc'])} | {f(p['drop_csr'])} | {f(p['adv_n_det'])} / "
              f"{f(p['clean_n_det'])} | {s['mean_linf'] * 255:.1f} | {s['mean_l2']:.2f} | {f(s['mean_ssim'])} |",
              flush=True)


if __name__ == "__main__":
    main()
