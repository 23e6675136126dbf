"""Images per second of a bare ``no_grad`` forward: the model as built, its inference copy with BatchNorm folded and
channels-last weights only, and the copy a run forwards (also ReLUs and residual additions in place), at several
batch sizes (``blackboxbench/prep/inference.py``). The three variants alternate ``--repeats`` times and the median
of each is printed, one markdown row per batch size as it finishes, with the largest logit difference of each copy
to the model as built.

``--malloc keep`` applies ``blackboxbench.malloc.keep_freed_memory`` first, as ``blackboxbench run`` does by
default; ``default`` leaves glibc's allocator as it is (freed activations go back to the kernel).

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/forward_rate.py --threads 2 --malloc keep
"""
import argparse
import statistics
import time

import torch

from blackboxbench.malloc import keep_freed_memory
from blackboxbench.prep.data import resolve_data_root
from blackboxbench.prep.inference import inference_copy
from blackboxbench.prep.models import build_model


def rate(model, xb, seconds):
    """Images per wall second of forwards of ``xb``, over at least ``seconds`` and 3 calls, after 2 warm-up calls."""
    with torch.no_grad():
        for _ in range(2):
            model(xb)
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds or calls < 3:
            model(xb)
            calls += 1
    return len(xb) * calls / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--model", default="cifar_resnet20")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 10, 32, 100, 200])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=0.5, help="seconds per measurement")
    ap.add_argument("--malloc", default="keep", choices=("keep", "default"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    model = build_model(args.model, resolve_data_root(args.data_root)).eval()
    probe = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    folded = inference_copy(model, probe, args.model, in_place_ops=False)
    run_copy = inference_copy(model, probe, args.model)
    variants = {"as built": model, "folded": folded, "folded + in place": run_copy}
    x = torch.rand(max(args.batches), 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x[:64])
        gaps = {k: float((m(x[:64]) - ref).abs().max()) for k, m in variants.items()}
    print(f"{args.model}, {args.threads} thread(s), malloc {args.malloc}; largest logit difference to the model as "
          f"built: folded {gaps['folded']:.1e}, folded + in place {gaps['folded + in place']:.1e}\n")
    print("| batch | " + " | ".join(f"{k} (images/s)" for k in variants) + " | in place / folded |")
    print("|---" * (len(variants) + 2) + "|")
    for b in args.batches:
        xb = x[:b].clone()
        got = {k: [] for k in variants}
        for _ in range(args.repeats):
            for k, m in variants.items():
                got[k].append(rate(m, xb, args.seconds))
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"| {b} | " + " | ".join(f"{med[k]:,.0f}" for k in variants)
              + f" | {med['folded + in place'] / med['folded']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
