"""Wall time of the transfer attacks that stack copies (SI, Admix, SIA) with ``hyper.copies_per_forward`` 1 (one
surrogate forward per copy, the default, as the authors' ``general_grad``) and 0 (all copies in one forward).

Surrogate ResNet-20 of the data root, the first ``--n`` CIFAR-10 test images, untargeted Linf 0.03
(``fidelity_transfer.build`` / ``run_ours``), ``--steps`` iterations; the two settings alternate ``--repeats`` times and the minimum of each is kept. Prints one row per
recipe as it finishes (markdown). Also the max abs difference of the two outputs (0 up to float rounding: the
setting changes how the work is batched, not the gradient).

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/transfer_copies.py --device cpu --threads 2
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

from blackboxbench.context import Pool
from blackboxbench.prep.models import build_model
from blackboxbench.registry import DATASET
from fidelity_transfer import build, run_ours


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--recipes", nargs="*", default=["si_fgsm", "admix", "sia"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    root = os.environ.get("BLACKBOXBENCH_DATA", str(Path(__file__).resolve().parent.parent.parent / "shared" / "data"))
    ds = DATASET.get("cifar10")(root, n=args.n, file="cifar10/cifar10_test_300.npz")
    x, y = ds.x.to(device), ds.y.to(device)
    pool = Pool(ds.x, ds.y)
    model = build_model("cifar_resnet20", root).to(device).eval()
    print(f"{args.n} images, {args.steps} iterations, device {device}, {torch.get_num_threads()} threads, "
          f"minimum of {args.repeats} alternating runs", flush=True)
    print("| recipe | copies per forward 1 (s) | all in one forward (s) | ratio 1 / all | max abs diff |", flush=True)
    print("|---|---|---|---|---|", flush=True)
    for recipe in args.recipes:
        atks = {per: build({"recipe": recipe, "hyper": {"iterations": args.steps, "copies_per_forward": per}})
                for per in (1, 0)}
        run_ours(atks[1], model, x[:2], y[:2], pool)  # warm-up
        best, outs = {1: float("inf"), 0: float("inf")}, {}
        for _ in range(args.repeats):
            for per, atk in atks.items():
                t0 = time.perf_counter()
                outs[per] = run_ours(atk, model, x, y, pool)
                best[per] = min(best[per], time.perf_counter() - t0)
        diff = (outs[1] - outs[0]).abs().max().item()
        print(f"| {recipe} | {best[1]:.2f} | {best[0]:.2f} | {best[1] / best[0]:.3f} | {diff:.4f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
