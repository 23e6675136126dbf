"""Peak memory of every query recipe on ImageNet-size images: does any attack hold per-slot tensors that grow with
the image and the number of slots beyond what fits a machine?

Each recipe runs in its own process (so each peak is its own) on the first ``--n`` NIPS-2017 images of the data
root resized to ``--size`` (299: the size of the TFLite and Inception-style targets), with ``--slots`` slots and a
budget of ``--budget`` queries (enough to pass the initialisation and several iterations of every attack). The
target is the CIFAR-10 ResNet-20 behind an adaptive average pool to 32 x 32, so an attack's own tensors have the
full image size while a forward costs what a CIFAR forward does; labels are the target's own predictions, so every
image is attacked. Surrogate attacks get ResNet-32 and ResNet-44 behind the same pool.

Recipes whose blocks train a prior on a ``train_images`` asset (AdvFlow, NP-attack, CG-Attack, MCG, NonLinear-BA,
PSBA: ``--priors`` scans just these) get one at the run's size: the ``--train-n`` NIPS-2017 images after the
``--n`` evaluation ones, labelled by the target, with the small training settings of ``SMALL`` (so that training
takes seconds, not hours; the attack's own per-slot tensors have the full image size whatever the prior's width).
The prior is trained once per recipe, in a process of its own into a scratch ``BLACKBOXBENCH_CACHE``, before the
measured runs, which load it: their peaks are the attack's, not the training's.

Each row: the process's peak resident memory (``ru_maxrss``) and its rise over the memory held after the models
and images were built, wall seconds, ASR and the largest per-sample query count. Run it at two slot counts to
see what grows with the slots, or pass several (``--slots 4,16``: one column each and the MB per slot between the
first and the last, the images fixed at ``--n``).

    BLACKBOXBENCH_DATA=../shared/data python benchmarks/memory_scan.py --slots 16
    BLACKBOXBENCH_DATA=../shared/data python benchmarks/memory_scan.py --priors --n 16 --slots 4,16 --budget 200
    BLACKBOXBENCH_DATA=../shared/data python benchmarks/memory_scan.py --slots 64 --recipes hsja_l2,geoda_l2
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
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
from blackboxbench.prep.data import Dataset, resolve_data_root  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.runner import run_tensors  # noqa: E402


# small training settings of the priors (the recipes' own train for hours at 299 x 299 on a CPU); each is the
# recipe's block whose parameters change. AdvFlow at an odd side is the authors' fully connected flow on all
# C*H*W values: at the recipe's width 128 that is 618 M parameters.
SMALL = {
    "advflow": ("perturb", {"epochs": 1, "n_blocks": 2, "internal_width": 8, "batch": 8}),
    "np_attack": ("perturb", {"epochs": 1, "r_dim": 8, "z_dim": 8, "hidden": 8, "batch": 8}),
    "cg_attack": ("perturb", {"epochs": 1, "x_hidden_channels": 4, "x_hidden_size": 8, "y_hidden_channels": 8,
                              "flow_depth": 1, "batch": 8}),
    "mcg": ("init", {"epochs": 1, "pretrain_epochs": 1, "pseudo_iters": 2, "x_hidden_channels": 4,
                     "x_hidden_size": 8, "y_hidden_channels": 8, "flow_depth": 1, "batch": 8, "chunk": 4}),
    "nonlinear_ba": ("perturb", {"epochs": 1, "views": 1}),
    "psba": ("perturb", {"epochs": 1, "views": 1}),
}


def small_settings(name):
    """The ``SMALL`` settings of ``name`` as text, or "" for a recipe without a prior."""
    if name not in SMALL:
        return ""
    block, params = SMALL[name]
    return f"{block}: " + ", ".join(f"{k} {v}" for k, v in params.items())


def reads_train_images(attack):
    return any(kind == "train_images" for _, kind in attack.meta["assets"].values())


def pooled(name, root):
    """The CIFAR-10 model ``name`` behind an adaptive average pool to 32 x 32 (any input size)."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(32), build_model(name, root)).eval()


def images(root, n, size, skip=0):
    """The NIPS-2017 images ``skip`` .. ``skip + n - 1`` resized to ``size`` x ``size``."""
    from PIL import Image

    files = sorted((root / "imagenet_nips17_subset100" / "images").glob("*.png"))[skip:skip + n]
    if len(files) < n:
        raise SystemExit(f"memory_scan: {len(files)} NIPS-2017 images under {root} after the first {skip}, "
                         f"asked for {n}")
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
    if args.one in SMALL:
        block, params = SMALL[args.one]
        recipe["blocks"][block] = {**recipe["blocks"][block], **params}
    t = finish_threat({"max_queries": args.budget}, recipe, recipe_family(recipe, source), source)
    attack = build_attack(recipe, t, source)
    target = pooled("cifar_resnet20", root)
    x = images(root, args.n, args.size)
    with torch.no_grad():
        y = target(x).argmax(1)
    models = {"model": [target]}
    if "surrogates" in attack.meta["needs"]:
        models["surrogates"] = [pooled("cifar_resnet32", root), pooled("cifar_resnet44", root)]
    assets = {}
    if reads_train_images(attack):  # the attacker's own images at the run's size, never the evaluation ones
        train_x = images(root, args.train_n, args.size, skip=args.n)
        with torch.no_grad():
            assets = {"train": Dataset("nips17 train", train_x, target(train_x).argmax(1), 10)}
    if args.warm:  # train the prior into the cache on one image and a few queries: the measured runs load it
        x, y = x[:1], y[:1]
    base, t0 = peak_mb(), time.perf_counter()
    row = dict(recipe=args.one, norm=t["norm"])
    try:
        records = run_tensors(attack, t, x, y, models, seed=0, slots=args.slots, num_classes=10, assets=assets)
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
    ap.add_argument("--slots", default="16", help="slot counts, comma-separated")
    ap.add_argument("--budget", type=int, default=400)
    ap.add_argument("--train-n", type=int, default=16, help="train_images of the recipes with a prior")
    ap.add_argument("--priors", action="store_true", help="only the recipes that train a prior on train_images")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--malloc", default="keep", choices=("keep", "default"),
                    help="keep: glibc keeps freed memory, as blackboxbench run does; default: glibc's own")
    ap.add_argument("--recipes", default=None, help="comma-separated; default: every score and decision recipe")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        args.slots = int(args.slots)
        return one(args)
    slots = [int(s) for s in args.slots.split(",")]
    names = args.recipes.split(",") if args.recipes else [
        k for k, p in entries().items() if p.parent.name in ("score", "decision") and (not args.priors or k in SMALL)]
    print(f"{args.n} NIPS-2017 images at {args.size} x {args.size}, {args.slots} slots, budget {args.budget}, "
          f"{args.threads} thread(s), malloc {args.malloc}; target: ResNet-20 behind a pool to 32 x 32\n")
    cols = [f"{s} slots: peak / rise MB, wall s" for s in slots] + (["MB per slot"] if len(slots) > 1 else [])
    print("| recipe | norm | prior's settings | " + " | ".join(cols) + " | ASR | max queries |")
    print("|---" * (len(cols) + 5) + "|", flush=True)
    cache = tempfile.mkdtemp(prefix="memory_scan_cache.")  # the priors of this scan, trained once each
    env = {**os.environ, "BLACKBOXBENCH_CACHE": cache}
    try:
        for name in names:
            print(row_of(name, args, slots, env), flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def run_one(name, args, slots, env, warm=False):
    """The JSON row of ``name`` run in a process of its own, or {"failed": its last line of stderr}."""
    passed = {k: v for k, v in vars(args).items() if v is not None and v is not False
              and k not in ("one", "recipes", "slots", "priors", "warm")}
    cmd = [sys.executable, __file__, "--one", name, f"--slots={slots}"] + ["--warm"] * warm + [
        f"--{k.replace('_', '-')}={v}" for k, v in passed.items()]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not lines:
        return {"failed": (out.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def row_of(name, args, slots, env):
    """The table row of ``name`` at each of ``slots`` (the prior trained first, in a run of its own)."""
    lead = f"| `{name}` | "
    if name in SMALL:
        warm = run_one(name, args, 1, env, warm=True)
        if "peak_mb" not in warm:
            return lead + f"| {small_settings(name)} | {warm.get('failed') or 'skipped: ' + warm['skipped']} |"
    rows = [run_one(name, args, s, env) for s in slots]
    bad = next((r for r in rows if "peak_mb" not in r), None)
    if bad:
        return lead + f"| {small_settings(name)} | {bad.get('failed') or 'skipped: ' + bad['skipped']} |"
    cells = [f"{r['peak_mb']:,} / {r['rise_mb']:,}, {r['wall_s']}" for r in rows]
    if len(slots) > 1:
        cells.append(f"{(rows[-1]['peak_mb'] - rows[0]['peak_mb']) / (slots[-1] - slots[0]):.1f}")
    last = rows[-1]
    return (lead + f"{last['norm']} | {small_settings(name)} | " + " | ".join(cells) +
            f" | {last['asr']:.3f} | {last['max_queries']} |")


if __name__ == "__main__":
    main()
