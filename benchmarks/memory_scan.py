"""Peak memory of every query recipe on ImageNet-size images: does any attack hold per-slot tensors that grow with
the image and the number of slots beyond what fits a machine?

Each recipe runs in its own process (so each peak is its own) on the first ``--n`` NIPS-2017 images of the data
root resized to ``--size`` (299: the size of the TFLite and Inception-style targets), with ``--slots`` slots and a
budget of ``--budget`` queries (enough to pass the initialisation and several iterations of every attack). The
target is the CIFAR-10 ResNet-20 behind an adaptive average pool to 32 x 32, so an attack's own tensors have the
full image size while a forward costs what a CIFAR forward does; labels are the target's own predictions, so every
image is attacked. Surrogate attacks get ResNet-32 and ResNet-44 behind the same pool. Recipes that need trained
assets at their own image size (the generative priors) are listed as skipped with the reason.

Each row: the process's peak resident memory (``ru_maxrss``) and its rise over the memory held after the models
and images were built, wall seconds, ASR and the largest per-sample query count. Run it at two slot counts to
see what grows with the slots.

    BLACKBOXBENCH_DATA=../shared/data python benchmarks/memory_scan.py --slots 16
    BLACKBOXBENCH_DATA=../shared/data python benchmarks/memory_scan.py --slots 64 --recipes hsja_l2,geoda_l2
"""
import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from blackboxbench.builder import build_attack, load_recipe, recipe_family  # noqa: E402
from blackboxbench.catalog import entries  # noqa: E402
from blackboxbench.config import finish_threat  # noqa: E402
from blackboxbench.errors import BenchError  # noqa: E402
from blackboxbench.malloc import keep_freed_memory  # noqa: E402
from blackboxbench.prep.data import resolve_data_root  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.runner import run_tensors  # noqa: E402


def pooled(name, root):
    """The CIFAR-10 model ``name`` behind an adaptive average pool to 32 x 32 (any input size)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(32), build_model(name, root)).eval()


def images(root, n, size):
    from PIL import Image

    files = sorted((root / "imagenet_nips17_subset100" / "images").glob("*.png"))[:n]
    if len(files) < n:
        raise SystemExit(f"memory_scan: {len(files)} NIPS-2017 images under {root}, --n asks for {n}")
    arr = [np.asarray(Image.open(f).convert("RGB").resize((size, size), Image.BILINEAR)) for f in files]
    return torch.from_numpy(np.stack(arr)).permute(0, 3, 1, 2).float().div(255)


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def one(args):
    """Run one recipe in this process and print its row as JSON."""
    torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        keep_freed_memory()
    root = resolve_data_root(args.data_root)
    recipe, source = load_recipe(args.one, "memory_scan")
    t = finish_threat({"max_queries": args.budget}, recipe, recipe_family(recipe, source), source)
    attack = build_attack(recipe, t, source)
    target = pooled("cifar_resnet20", root)
    x = images(root, args.n, args.size)
    with torch.no_grad():
        y = target(x).argmax(1)
    models = {"model": [target]}
    if "surrogates" in attack.meta["needs"]:
        models["surrogates"] = [pooled("cifar_resnet32", root), pooled("cifar_resnet44", root)]
    base, t0 = peak_mb(), time.perf_counter()
    row = dict(recipe=args.one, norm=t["norm"])
    try:
        records = run_tensors(attack, t, x, y, models, seed=0, slots=args.slots, num_classes=10)
    except BenchError as e:
        print(json.dumps({**row, "skipped": str(e)}))
        return
    attacked = [r for r in records if r["attacked"]]
    print(json.dumps({**row, "peak_mb": round(peak_mb()), "rise_mb": round(peak_mb() - base),
                      "wall_s": round(time.perf_counter() - t0, 1),
                      "asr": round(sum(r["success"] for r in attacked) / max(1, len(attacked)), 3),
                      "max_queries": max((r["queries"] for r in attacked), default=0)}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--n", type=int, default=16, help="images (at most 100)")
    ap.add_argument("--size", type=int, default=299)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--budget", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--malloc", default="keep", choices=("keep", "default"),
                    help="keep: glibc keeps freed memory, as blackboxbench run does; default: glibc's own")
    ap.add_argument("--recipes", default=None, help="comma-separated; default: every score and decision recipe")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    names = args.recipes.split(",") if args.recipes else [
        k for k, p in entries().items() if p.parent.name in ("score", "decision")]
    print(f"{args.n} NIPS-2017 images at {args.size} x {args.size}, {args.slots} slots, budget {args.budget}, "
          f"{args.threads} thread(s), malloc {args.malloc}; target: ResNet-20 behind a pool to 32 x 32\n")
    print("| recipe | norm | peak MB | rise MB | wall s | ASR | max queries |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name in names:
        passed = {k: v for k, v in vars(args).items() if v is not None and k not in ("one", "recipes")}
        cmd = [sys.executable, __file__, "--one", name] + [f"--{k.replace('_', '-')}={v}" for k, v in passed.items()]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not lines:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"| `{name}` | failed: {tail} |||||", flush=True)
            continue
        r = json.loads(lines[-1])
        if "skipped" in r:
            print(f"| `{name}` | {r['norm']} | skipped: {r['skipped']} |||||", flush=True)
            continue
        print(f"| `{name}` | {r['norm']} | {r['peak_mb']:,} | {r['rise_mb']:,} | {r['wall_s']} | {r['asr']:.3f} | "
              f"{r['max_queries']} |", flush=True)


if __name__ == "__main__":
    main()
