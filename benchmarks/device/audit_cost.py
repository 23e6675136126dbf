"""What the audit's forwards cost (``family.audit_logits``): milliseconds an image for a batched forward (the run's
own verdicts), for calls of one image (the audit on a CPU) and for calls of ``AUDIT_CALL_CUDA`` padded images (the
audit on CUDA), on the run's inference copy of each model, one markdown row per model as it finishes.

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/device/audit_cost.py --device cuda
"""
import argparse
import time

import torch

from blackboxbench.family import AUDIT_CALL_CUDA, audit_logits, forward_logits
from blackboxbench.prep.data import resolve_data_root
from blackboxbench.prep.inference import inference_copy
from blackboxbench.prep.models import build_model


def ms_per_image(fn, x, device, repeats=3):
    """The best of ``repeats`` timed calls of ``fn(x)`` after one warm-up, in milliseconds an image."""
    fn(x)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 1000 * best / len(x)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--models", default="cifar_resnet20,cifar_resnet56")
    ap.add_argument("--n", type=int, default=256, help="images (random, CIFAR-10 size)")
    args = ap.parse_args()
    device = torch.device(args.device)
    root = resolve_data_root(args.data_root)
    x = torch.rand(args.n, 3, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    print(f"| model ({device.type}, {args.n} images) | batched ms/image | alone | calls of {AUDIT_CALL_CUDA} |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        model = inference_copy(build_model(name, root, device), x[:8], name)
        cells = [ms_per_image(lambda v: forward_logits(model, v, name), x, device)]
        cells += [ms_per_image(lambda v, k=k: audit_logits(model, v, name, k), x, device) for k in (1, AUDIT_CALL_CUDA)]
        print(f"| {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
