"""Torch ops dispatched and host syncs per model call: a CPU proxy of what a launch-bound GPU pays per step.

On a GPU a small model's forward takes about as long as launching its kernels (an H200 runs ResNet-20 at batch
100 in 1.9 ms), so an attack's wall time follows the number of torch ops its step dispatches and the host syncs
that stop the CPU from running ahead (``item``, ``nonzero``, a tensor's truth value). This script counts both at
the dispatcher (``TorchDispatchMode``) for our recipes and torchattacks' Square, on 100 random images and a model
of negligible cost, and can attribute our ops to the library function that issued them.

    python benchmarks/dispatch_ops.py --attacks square_linf,nes,simba_dct,hsja_linf --budget 200 --by-function
"""
import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]  # a checkout

from compare_peers import build_ours  # noqa: E402
from blackboxbench.runner import run_tensors  # noqa: E402

SYNCS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}
LIB = f"{Path(__file__).resolve().parents[1] / 'blackboxbench'}/"


class Counting(TorchDispatchMode):
    """Counts every op reaching the dispatcher and the host syncs among them, by the innermost library frame."""

    def __init__(self):
        super().__init__()
        self.ops, self.syncs = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f, where = sys._getframe(1), "(outside the library)"
        while f is not None:
            if f.f_code.co_filename.startswith(LIB):
                where = f"{f.f_code.co_filename[len(LIB):]}:{f.f_code.co_name}"
                break
            f = f.f_back
        self.ops[where] += 1
        self.syncs[where] += str(func) in SYNCS
        return func(*args, **(kwargs or {}))


class Calls(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.n = model, 0

    def forward(self, x):
        self.n += 1
        return self.model(x)


def tiny_problem(n):
    """A model of negligible cost and ``n`` random images it classifies as labelled."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 8, stride=8), nn.Flatten(), nn.Linear(8 * 16, 10)).eval()
    for p in model.parameters():
        p.requires_grad_(False).copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.rand(n, 3, 32, 32, generator=g)
    with torch.no_grad():
        return model, x, model(x).argmax(1)


def count(fn, model):
    calls, mode = Calls(model), Counting()
    with mode:
        fn(calls)
    return calls.n, mode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attacks", default="square_linf")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--eps", type=float, default=2 / 255, help="Linf eps (L2 recipes take 0.3)")
    ap.add_argument("--by-function", action="store_true", help="our ops per call by the library function")
    args = ap.parse_args(argv)
    model, x, y = tiny_problem(args.n)
    print(f"{args.n} random images, a model of negligible cost, budget {args.budget}, one thread")
    print("| attack | library | model calls | ops per call | host syncs per call |\n|---|---|---|---|---|")
    for name in args.attacks.split(","):
        norm = "l2" if name.endswith("l2") else "linf"
        attack, t = build_ours(name, {"norm": norm, "eps": args.eps if norm == "linf" else 0.3})
        t = dict(t, max_queries=args.budget)
        calls, mode = count(lambda m: run_tensors(attack, t, x, y, {"model": [m]}, seed=0, slots=args.n), model)
        print(f"| {name} | ours | {calls} | {sum(mode.ops.values()) / calls:.0f} | "
              f"{sum(mode.syncs.values()) / calls:.1f} |", flush=True)
        if args.by_function:
            for where, k in mode.ops.most_common(15):
                print(f"|  | {where} |  | {k / calls:.1f} | {mode.syncs[where] / calls:.1f} |")
    try:
        import torchattacks
    except ImportError:
        print("torchattacks is not installed: its row is left out")
        return
    calls, mode = count(lambda m: torchattacks.Square(m, norm="Linf", eps=args.eps, n_queries=args.budget,
                                                      p_init=0.05, n_restarts=1, seed=0, loss="margin")(x, y), model)
    print(f"| Square Linf | torchattacks {torchattacks.__version__} | {calls} | "
          f"{sum(mode.ops.values()) / calls:.0f} | {sum(mode.syncs.values()) / calls:.1f} |")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
