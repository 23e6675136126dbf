"""How well a tiny shapes detector tells the classes apart, by training length: for each ``--steps`` value, train
``shapes_fcos`` (not cached) and report, over the ground-truth boxes of the first ``--n`` shapes test images, how
often the best-scored detection at IoU >= 0.5 has the right label, and the median score gap between the two best
labels there. A detector that finds the boxes but not the classes keeps every label above its threshold, and
then no mislabel attack can lower CSR (benchmarks/RESULTS.md, "Tiny detectors v2").

Run: ``python benchmarks/tiny_detector_quality.py --steps 400 800 1200``.
"""
import argparse
import sys
import time
from pathlib import Path

import torch
from torchvision.ops import box_iou

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from blackboxbench.detection.data import shapes  # noqa: E402
from blackboxbench.detection.models import train_tiny  # noqa: E402


def class_quality(net, data):
    """(share of ground-truth boxes whose best detection at IoU >= 0.5 has the right label, median score gap
    between the best two detections there); boxes with no detection count as wrong."""
    with torch.no_grad():
        outs = net(list(data.x))
    right, total, gaps = 0, 0, []
    for out, gt in zip(outs, data.targets):
        if not len(gt["boxes"]):
            continue
        iou = box_iou(gt["boxes"], out["boxes"]) if len(out["boxes"]) else torch.zeros(len(gt["boxes"]), 0)
        for k in range(len(gt["boxes"])):
            total += 1
            near = iou[k] >= 0.5
            if not near.any():
                continue
            scores, labels = out["scores"][near], out["labels"][near] - 1  # model label 0 is the background
            right += int(labels[scores.argmax()] == gt["labels"][k])
            top = scores.sort(descending=True).values
            gaps.append(float(top[0] - (top[1] if len(top) > 1 else 0)))
    return right / max(total, 1), (sorted(gaps)[len(gaps) // 2] if gaps else float("nan"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[400, 800])
    ap.add_argument("--n", type=int, default=64)
    args = ap.parse_args()
    data = shapes(None, n=args.n)
    print("| training steps | train s | right top label | median score gap |\n|---|---|---|---|")
    for steps in args.steps:
        t0 = time.perf_counter()
        net = train_tiny("shapes_fcos", iterations=steps)
        acc, gap = class_quality(net, data)
        print(f"| {steps} | {time.perf_counter() - t0:.0f} | {acc:.2f} | {gap:.2f} |", flush=True)


if __name__ == "__main__":
    main()
