#!/usr/bin/env python
"""Seconds per image of every detection recipe (white-box: the surrogate is the target) over the first ``--n``
shapes test images, with the relative drops of mAP / AP_loc / CSR and the detection ratio.

    python benchmarks/detection_speed.py --threads 2 --n 16 [--only tog_vanishing,dag]

The issue's GPU figure (the od benchmark reports 17 s for EBAD, 44 s for OSFD and 84 s for CAA per image on a
TITAN RTX): torchvision's Faster R-CNN at 512 px with random weights, a random-weight FCOS as the second surrogate
of the ensembles (EBAD, CAA; the benchmark's YOLOv3), and the score threshold lowered so that the random heads
return detections to attack (4 classes, labels mapped one to one to the 3 shapes):

    python benchmarks/detection_speed.py --device cuda --n 2 --size 512 --score-thr 0.0 --max-det 20 --only \\
        ebad_10,osfd,caa_10 --model "{name: torchvision_det, arch: fasterrcnn_resnet50_fpn, num_classes: 4, \\
        label_map: identity}" --extra "{name: torchvision_det, arch: fcos_resnet50_fpn, num_classes: 4, \\
        label_map: identity}"
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import yaml  # noqa: E402

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
    ap.add_argument("--model", default="shapes_fcos", help="the surrogate and target (a zoo name, name:arch, or a "
                    "spec in YAML flow form)")
    ap.add_argument("--extra", default="", help="a second surrogate for the ensembles (EBAD, CAA)")
    ap.add_argument("--size", type=int, default=64, help="side of the shapes images")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--score-thr", type=float, default=None, help="harmonized score threshold (threat.score_thr)")
    ap.add_argument("--max-det", type=int, default=None, help="harmonized detection cap (threat.max_det)")
    ap.add_argument("--craft", default="", help="craft settings over every recipe's, in YAML flow form (e.g. "
                    "'{iterations: 2}' for a short run of big detectors on CPU)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    spec = lambda text: yaml.safe_load(text) if text.startswith("{") else text  # noqa: E731
    model, data = build_model(spec(args.model), device=dev), shapes(None, n=args.n, size=args.size)
    extra = [build_model(spec(args.extra), device=dev)] if args.extra else []
    print(f"model {args.model}, extra surrogate {args.extra or '-'}, {args.n} shapes images of {args.size} px, "
          f"device {dev}, score_thr {args.score_thr}, max_det {args.max_det}, craft settings {args.craft or '-'}")
    fam = FAMILY.get("detection")
    names = [n for n, p in catalog.entries("attacks").items() if load_yaml(p)["family"] == "detection"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    print("| recipe | eps | s / image | drop mAP | drop AP_loc | drop CSR | detections adv / clean | mean Linf (x255) "
          "| mean L2 | mean SSIM |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        recipe, src = load_recipe({"recipe": name, "blocks": {"craft": yaml.safe_load(args.craft)}} if args.craft
                                  else name, "bench")
        t = finish_threat({"score_thr": args.score_thr, "max_det": args.max_det}, recipe, fam, "bench")
        attack = build_attack(recipe, t, src)
        assets = {k: ATTACKER_ASSETS[kind](None) for k, (_, kind) in attack.meta["assets"].items()}
        run = RunInputs(attack=attack, threat=t, data=data,
                        models={"surrogates": [model, *extra], "targets": [model]},
                        model_names={"surrogates": ["m", "e"][:1 + len(extra)], "targets": ["m"]},
                        streams=Streams(0, args.n, dev), device=dev, slots=args.n, assets=assets, save_adv=False)
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
