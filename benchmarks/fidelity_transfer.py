"""Transfer attacks of the data / optimization perspective: fidelity against torchattacks 3.5.1, direction of effect
and a composite table (the paper's Fig. 7), on the data root's CIFAR-10 (first 100 test images).

Surrogate ResNet-20; targets ResNet-32/44/56 and the two plain CNNs ``oval_cifar_wide`` and ``cifar_cnn_a_mix``.
ASR on a target counts the images it classifies correctly when clean (spec sheet 10.15); every adversarial image,
ours and torchattacks', is quantized to uint8 towards the clean image before it is judged.

Parts (``--part``, default all):

* ``fidelity``: NI-FGSM, SINI-FGSM, VMI-FGSM, VNI-FGSM, DI and TI, ours (the recipes, with the peer's
  parameters) and torchattacks', same eps 0.03, step 0.003, 10 steps, decay; per-target ASR, the difference, and
  the wall time of each (ratio ours / torchattacks, measured in this one run). ``--seeds k``: both sides run
  once per seed and the table compares mean ASRs (randomized attacks such as DI vary by 2-3 pp between seeds).
* ``timing``: the same work timed again, ours and torchattacks' alternating ``--repeats`` times on ``--timing-n``
  images: the minimum of each (a shared machine disturbs single runs), their ratio, and the median of the per-pair
  ratios with its 95 % sign-test interval (``--repeats`` >= 6). ``--malloc keep`` (the default, as ``blackboxbench
  run``) sets glibc to keep freed memory for the whole process, both sides alike (:mod:`blackboxbench.malloc`).
* ``direction``: untargeted Linf 0.03 (``--norm l2``: L2 1, step 0.1), every new recipe against ``i_fgsm``, mean
  transfer ASR over the targets.
  10 iterations (the original papers' count; the recipes' 100 cost 10x the CPU), RAP 40 with late start 10.
* ``composites``: new blocks (cheap settings) x {alone, +MI, +DI, +NI} on the first ``--composite-n`` images, mean transfer ASR,
  as a CSV and a heatmap PNG (gray: incompatible pair).

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/fidelity_transfer.py --part fidelity

Appends its tables to ``--md`` (default benchmarks/transfer_fidelity.md).
"""
import argparse
import copy
import csv
import os
import sys
import time
from pathlib import Path

import torch

from blackboxbench.builder import build_attack, load_recipe, recipe_family
from blackboxbench.config import finish_threat
from blackboxbench.context import BlockContext, Pool
from blackboxbench.errors import ConfigError
from blackboxbench.malloc import keep_freed_memory
from blackboxbench.prep.models import build_model
from blackboxbench.registry import DATASET
from blackboxbench.rng import Streams
from blackboxbench.stats import median_interval
from blackboxbench.threat import Problem, quantize

HERE = Path(__file__).resolve().parent
EPS, ALPHA, STEPS = 0.03, 0.003, 10
L2_EPS = 1.0  # direction --norm l2: Table VII, CIFAR-10 (step eps / 10)
TARGETS = ("cifar_resnet32", "cifar_resnet44", "cifar_resnet56", "oval_cifar_wide", "cifar_cnn_a_mix")


def build(recipe, targeted=False, eps=EPS, norm="linf"):
    """An attack from a recipe mapping (``{"recipe": name, <overrides>}`` or inline) through the real builder."""
    rec, source = load_recipe(copy.deepcopy(recipe), "fidelity_transfer")
    t = {"norm": norm, "targeted": targeted, "eps": eps}
    t = finish_threat(t, rec, recipe_family(rec, source), source)
    return build_attack(rec, t, source)


def run_ours(atk, model, x, y, pool, seed=0, eps=EPS, norm="linf"):
    """``atk`` on ``x`` (on the model's device); waits for a GPU to finish, so that wall clocks are fair."""
    problem = Problem(x=x, y=y, eps=eps, norm=norm, num_classes=10)
    ctx = BlockContext(problem=problem, rng=Streams(seed, len(x), x.device).view(torch.arange(len(x))),
                       pool=pool, model=model, iterations=atk.iterations, alpha=atk.alpha)
    out = atk.run(ctx)
    if x.device.type == "cuda":
        torch.cuda.synchronize()
    return out


def asr(models, x_adv, x, y):
    """{target: ASR over the images it classifies correctly when clean}."""
    out = {}
    with torch.no_grad():
        for name, m in models.items():
            ok = m(x).argmax(1) == y
            adv = m(x_adv).argmax(1) != y
            out[name] = (adv & ok).sum().item() / max(ok.sum().item(), 1)
    return out


def ours_recipe(name, steps=STEPS, blocks=None):
    r = {"recipe": name, "hyper": {"iterations": steps, "alpha": ALPHA}}
    if blocks:
        r["blocks"] = blocks
    return r


def peers():
    import torchattacks

    return {
        "NI-FGSM": (ours_recipe("ni_fgsm"), lambda m: torchattacks.NIFGSM(m, EPS, ALPHA, STEPS, 1.0)),
        "SINI-FGSM": (ours_recipe("ni_fgsm", blocks={"transform": [{"name": "si", "copies": 5, "scale": 2.0}]}),
                      lambda m: torchattacks.SINIFGSM(m, EPS, ALPHA, STEPS, 1.0, m=5)),
        "VMI-FGSM": (ours_recipe("vt"), lambda m: torchattacks.VMIFGSM(m, EPS, ALPHA, STEPS, 1.0, N=5, beta=1.5)),
        "VNI-FGSM": (ours_recipe("vni"), lambda m: torchattacks.VNIFGSM(m, EPS, ALPHA, STEPS, 1.0, N=5, beta=1.5)),
        "DI": (ours_recipe("di2_fgsm"), lambda m: torchattacks.DIFGSM(m, EPS, ALPHA, STEPS, 0.0, resize_rate=1.25,
                                                                         diversity_prob=0.5)),
        # torchattacks' DI never resizes back: at resize_rate 1.25 the model sees 40 x 40 bilinear canvases, a
        # different transform; at its default 0.9 it shrinks to [28, 32) and pads to 32, the same input size as
        # ours (nearest resize to [32, 40], pad to 40, nearest resize back to 32: a scale in [0.8, 1]).
        "DI (peer 0.9)": (ours_recipe("di2_fgsm"), lambda m: torchattacks.DIFGSM(m, EPS, ALPHA, STEPS, 0.0,
                                                                                   resize_rate=0.9,
                                                                                   diversity_prob=0.5)),
        "DI (peer 0.9, nearest)": (ours_recipe("di2_fgsm"), lambda m: nearest_di(torchattacks)(
            m, EPS, ALPHA, STEPS, 0.0, resize_rate=0.9, diversity_prob=0.5)),
        # The same transform as torchattacks' default DI: our di_shrink block (bilinear shrink into the 32 x 32
        # canvas, no resize back), drawn per sample instead of per batch.
        "DI (di_shrink 0.9)": (ours_recipe("di2_fgsm", blocks={"transform": [
            {"name": "di_shrink", "resize_rate": 0.9, "prob": 0.5}]}),
            lambda m: torchattacks.DIFGSM(m, EPS, ALPHA, STEPS, 0.0, resize_rate=0.9, diversity_prob=0.5)),
        "TI": (ours_recipe("ti_fgsm"), lambda m: torchattacks.TIFGSM(m, EPS, ALPHA, STEPS, 0.0, len_kernel=3,
                                                                        nsig=3, diversity_prob=0.0)),
    }


def nearest_di(torchattacks):
    """torchattacks' DIFGSM with its resize made nearest-neighbour (as Xie et al.'s code and ours), by running its
    own ``input_diversity`` with ``F.interpolate`` switched to mode nearest for the call."""
    mod = sys.modules[torchattacks.DIFGSM.__module__]

    class NearestDI(torchattacks.DIFGSM):
        def input_diversity(self, x):
            interp = mod.F.interpolate
            mod.F.interpolate = lambda t, size, mode, align_corners: interp(t, size=size, mode="nearest")
            try:
                return super().input_diversity(x)
            finally:
                mod.F.interpolate = interp

    return NearestDI


def mean_sd(dicts):
    """Per key: the mean and the (population) standard deviation over a list of {target: ASR} dicts."""
    out = {}
    for k in dicts[0]:
        v = [d[k] for d in dicts]
        m = sum(v) / len(v)
        out[k] = (m, (sum((a - m) ** 2 for a in v) / len(v)) ** 0.5)
    return out


def fidelity(models, surrogate, x, y, pool, md, only=None, seeds=1):
    """Ours and torchattacks' on the same images; with ``seeds`` > 1 both run once per seed (ours: the per-sample
    streams of that seed; torchattacks: ``torch.manual_seed``) and the table gives mean ASRs, so a randomized
    attack (DI draws one size and one coin per batch in torchattacks) is compared on its mean, not one draw."""
    rows = []
    for label, (recipe, peer) in peers().items():
        if only and label not in only:
            continue
        atk, a_runs, b_runs, t_ours, t_ta = build(recipe), [], [], 0.0, 0.0
        for seed in range(seeds):
            t0 = time.perf_counter()
            ours = run_ours(atk, surrogate, x, y, pool, seed=seed)
            t_ours += time.perf_counter() - t0
            torch.manual_seed(seed)
            ta = peer(surrogate)
            t0 = time.perf_counter()
            theirs = ta(x, y).detach()
            t_ta += time.perf_counter() - t0
            a_runs.append(asr(models, ours, x, y))
            b_runs.append(asr(models, quantize(theirs.clamp(0, 1), x), x, y))
        a, b = mean_sd(a_runs), mean_sd(b_runs)
        rows.append((label, a, b, t_ours / seeds, t_ta / seeds))
        print(label, {k: round(a[k][0] - b[k][0], 3) for k in a}, f"{t_ours:.1f}s / {t_ta:.1f}s", flush=True)
    names = list(models)
    over = f", mean of {seeds} seeds (+- the seed-to-seed sd, pp)" if seeds > 1 else ""
    lines = ["", f"### Fidelity vs torchattacks 3.5.1 ({len(x)} CIFAR-10 images, surrogate ResNet-20, untargeted Linf "
             f"{EPS}, step {ALPHA}, {STEPS} steps; ASR ours / torchattacks (difference, pp){over})", "",
             "| attack | " + " | ".join(names) + " | max abs diff pp | time ours s | time torchattacks s | ratio |",
             "|---|" + "---|" * (len(names) + 4)]
    for label, a, b, t1, t2 in rows:
        diffs = [100 * (a[n][0] - b[n][0]) for n in names]
        sd = (lambda n: f" +-{100 * a[n][1]:.0f}/{100 * b[n][1]:.0f}") if seeds > 1 else (lambda n: "")
        cells = [f"{a[n][0]:.2f} / {b[n][0]:.2f} ({d:+.0f}{sd(n)})" for n, d in zip(names, diffs)]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {max(abs(d) for d in diffs):.0f} | {t1:.1f} | "
                     f"{t2:.1f} | {t1 / t2:.2f} |")
    write(md, lines)


def median_ci(values, level=0.95):
    """The median of ``values`` and its distribution-free (sign-test) interval, :func:`blackboxbench.stats.
    median_interval`: (median, low, high); low / high are None when the values are too few (n < 6 at 95 %)."""
    v, n = sorted(values), len(values)
    return ((v[(n - 1) // 2] + v[n // 2]) / 2, *median_interval(values, level))


def timing(surrogate, x, y, pool, md, repeats=3, only=None, malloc="default"):
    """Wall time of the same work, ours and torchattacks', alternating ``repeats`` times; the minimum of each
    (the least disturbed run on a shared machine), their ratio, and the median of the per-pair ratios (each of
    our runs over the torchattacks run next to it: slow drifts of the machine cancel) with its 95 % sign-test
    interval (``repeats`` >= 6). The order alternates (ours first, then torchattacks first), so neither side
    always runs after the other. Both sides run once untimed first (allocator and kernel warm-up)."""
    rows = []
    for label, (recipe, peer) in peers().items():
        if only and label not in only:
            continue
        atk, times = build(recipe), ([], [])

        def ours():
            run_ours(atk, surrogate, x, y, pool)

        def theirs():
            torch.manual_seed(0)
            peer(surrogate)(x, y)

        ours(), theirs()
        for r in range(repeats):  # A B, then B A: neither side always runs first
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                (ours, theirs)[side]()
                times[side].append(time.perf_counter() - t0)
        med, lo, hi = median_ci([a / b for a, b in zip(*times)])
        rows.append((label, min(times[0]), min(times[1]), med, lo, hi))
        ci = "" if lo is None else f" (95 % interval {lo:.3f}-{hi:.3f})"
        print(label, f"{rows[-1][1]:.2f}s / {rows[-1][2]:.2f}s = {rows[-1][1] / rows[-1][2]:.3f}, median pair "
              f"ratio {med:.3f}{ci}", flush=True)
    lines = ["", f"### Wall time vs torchattacks ({len(x)} images, {STEPS} steps, {torch.get_num_threads()} thread(s), "
             f"{repeats} alternating runs, malloc {malloc})", "", "| attack | ours s (min) | torchattacks s (min) | ratio of minima | "
             "median of per-pair ratios | 95 % interval of that median |", "|---|---|---|---|---|---|"]
    lines += [f"| {label} | {a:.2f} | {b:.2f} | {a / b:.3f} | {m:.3f} | "
              f"{'-' if lo is None else f'{lo:.3f}-{hi:.3f}'} |" for label, a, b, m, lo, hi in rows]
    write(md, lines)


DIRECTION = {
    "i_fgsm": ours_recipe("i_fgsm"), "mi_fgsm": ours_recipe("mi_fgsm"), "ni_fgsm": ours_recipe("ni_fgsm"),
    "pi_fgsm": ours_recipe("pi_fgsm"),
    "vt": ours_recipe("vt"), "si_fgsm": ours_recipe("si_fgsm"), "admix": ours_recipe("admix"),
    "sia": ours_recipe("sia"), "pgn": ours_recipe("pgn"),
    # SIA with momentum (Wang et al.'s setting) and with more iterations, to explain its rank on these models
    "sia+mi": ours_recipe("sia", blocks={"direction": [{"name": "momentum", "decay": 1.0}]}),
    "sia+mi (30 it)": ours_recipe("sia", steps=30, blocks={"direction": [{"name": "momentum", "decay": 1.0}]}),
    "i_fgsm (30 it)": ours_recipe("i_fgsm", steps=30), "ni_fgsm (30 it)": ours_recipe("ni_fgsm", steps=30),
    "pi_fgsm (30 it)": ours_recipe("pi_fgsm", steps=30),
    "rap": ours_recipe("rap", steps=40, blocks={"gradient": [{"name": "rap", "late_start": 10,
                                                               "inner_iterations": 5}]}),
    # at the recipes' own Table VII count (100 iterations untargeted)
    **{f"{r} (100 it)": ours_recipe(r, steps=100)
       for r in ("i_fgsm", "ni_fgsm", "pi_fgsm", "vt", "si_fgsm", "admix", "sia", "pgn")},
    "rap (400 it)": ours_recipe("rap", steps=400),
    # the paper's remedy for momentum over-accumulation (Sec. V, query number budget, Fig. 19a): a smaller step
    "mi_fgsm (100 it)": ours_recipe("mi_fgsm", steps=100),
    **{f"ni_fgsm (100 it, step {s})": {"recipe": "ni_fgsm", "hyper": {"iterations": 100, "alpha": s}}
       for s in ("eps/100", "eps/30")},
}


def direction(models, surrogate, x, y, pool, md, only=None, norm="linf"):
    # L2: Table VII's CIFAR-10 eps 1 and step 0.1 (eps / 10) in place of Linf's 0.03 and 0.003
    eps, alpha = (EPS, ALPHA) if norm == "linf" else (L2_EPS, L2_EPS / 10)
    rows = []
    for name, recipe in DIRECTION.items():
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        recipe = copy.deepcopy(recipe)
        if norm != "linf" and recipe["hyper"].get("alpha") == ALPHA:
            recipe["hyper"]["alpha"] = alpha
        x_adv = run_ours(build(recipe, eps=eps, norm=norm), surrogate, x, y, pool, eps=eps, norm=norm)
        a = asr(models, x_adv, x, y)
        white = asr({"surrogate": surrogate}, x_adv, x, y)["surrogate"]
        rows.append((name, a, sum(a.values()) / len(a), time.perf_counter() - t0, white))
        print(name, round(rows[-1][2], 3), f"white-box {white:.2f}", f"{rows[-1][3]:.0f}s", flush=True)
    names = list(models)
    iters = {name: DIRECTION[name]["hyper"]["iterations"] for name, *_ in rows}
    # each row against the plain i_fgsm run of its own iteration count, else the 10-iteration one
    bases = {iters[n]: m for n, _, m, _, _ in rows if DIRECTION[n].get("blocks") is None
             and DIRECTION[n]["recipe"] == "i_fgsm"}
    lines = ["", f"### Direction of effect ({len(x)} images, untargeted {norm} {eps}, step {alpha}, {STEPS} iterations "
             "unless the name says otherwise; RAP 40 with late start 10; transfer ASR from ResNet-20)", "",
             "| recipe | white-box R20 | " + " | ".join(names) + " | mean | beats i_fgsm (same iterations, else "
             f"{STEPS}) | time s |", "|---|" + "---|" * (len(names) + 4)]
    for name, a, mean, t, white in sorted(rows, key=lambda r: -r[2]):
        base = bases.get(iters[name], bases[STEPS])
        beats = "-" if DIRECTION[name]["recipe"] == "i_fgsm" else "yes" if mean > base else "NO"
        lines.append(f"| `{name}` | {white:.2f} | " + " | ".join(f"{a[n]:.2f}" for n in names) + f" | {mean:.3f} | "
                     f"{beats} | {t:.0f} |")
    write(md, lines)


# new blocks (rows) composed with old ones (columns); each a blocks mapping merged into i_fgsm's
MOM = {"direction": [{"name": "momentum", "decay": 1.0}]}
NEW = {  # cheap settings (CPU): VT and PGN 2 neighbours, Admix 2 images, SIA 4 copies, RAP 20 iterations
    "NI": {"gradient": [{"name": "nesterov"}], **MOM},
    "PI": {"gradient": [{"name": "pregrad", "step": 0.01}], **MOM},
    "VT (n 2)": {"gradient": [{"name": "vt", "n": 2, "bound": 1.5}], **MOM},
    "PGN (n 2)": {"gradient": [{"name": "pgn", "n": 2}], **MOM},
    "RAP (20 it, late 5, inner 2)": {"gradient": [{"name": "rap", "late_start": 5, "inner_iterations": 2}]},
    "SI": {"transform": [{"name": "si", "copies": 3, "scale": 1.5}]},
    "Admix (2)": {"transform": [{"name": "admix", "n_samples": 2}, {"name": "si", "copies": 3, "scale": 1.5}]},
    "SIA (4 copies)": {"transform": [{"name": "sia", "copies": 4}]},
}
OLD = {
    "alone": {},
    "MI": MOM,
    "DI": {"transform": [{"name": "di", "resize_rate": 1.25, "prob": 0.5}]},
    "NI": {"gradient": [{"name": "nesterov"}], **MOM},
}


def compose(a, b):
    """Union of two block mappings: transform and gradient lists concatenated, directions deduplicated."""
    out = {}
    for kind in ("transform", "gradient", "direction"):
        items = a.get(kind, []) + b.get(kind, [])
        if kind == "direction":
            items = [d for i, d in enumerate(items) if d not in items[:i]]
        out[kind] = items
    return out


def composites(models, surrogate, x, y, pool, csv_path, png_path, md):
    rows = []
    for rname, rb in NEW.items():
        steps = 20 if rname.startswith("RAP") else STEPS
        row = {}
        for cname, cb in OLD.items():
            recipe = {"recipe": "i_fgsm", "hyper": {"iterations": steps, "alpha": ALPHA}, "blocks": compose(rb, cb)}
            try:
                atk = build(recipe)
            except ConfigError as e:
                print(rname, cname, "incompatible:", str(e).split(": ", 2)[-1], flush=True)
                row[cname] = float("nan")
                continue
            a = asr(models, run_ours(atk, surrogate, x, y, pool), x, y)
            row[cname] = sum(a.values()) / len(a)
            print(rname, cname, round(row[cname], 3), flush=True)
        rows.append((rname, row))
    cols = list(OLD)
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["block"] + [f"+{c}" if c != "alone" else c for c in cols] + ["average"])
        for rname, row in rows:
            vals = [row[c] for c in cols]
            ok = [v for v in vals if v == v]
            w.writerow([rname] + [f"{v:.3f}" if v == v else "" for v in vals] + [f"{sum(ok) / len(ok):.3f}"])
    heatmap(rows, cols, png_path, len(x))
    lines = ["", f"### Composites (mean transfer ASR over the 5 targets, first {len(x)} images, untargeted Linf {EPS}, "
             f"{STEPS} iterations; blank: incompatible)", "", f"CSV `{csv_path.name}`, heatmap `{png_path.name}`.", "",
             "| block | " + " | ".join(cols) + " | average |", "|---|" + "---|" * (len(cols) + 1)]
    for rname, row in rows:
        vals = [row[c] for c in cols]
        ok = [v for v in vals if v == v]
        lines.append(f"| {rname} | " + " | ".join(f"{v:.2f}" if v == v else "" for v in vals)
                     + f" | {sum(ok) / len(ok):.2f} |")
    write(md, lines)


def heatmap(rows, cols, path, n):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.array([[row[c] for c in cols] + [np.nanmean([row[c] for c in cols])] for _, row in rows])
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=80)
    cmap = matplotlib.colormaps["viridis"].copy()
    cmap.set_bad("lightgray")
    im = ax.imshow(np.ma.masked_invalid(data), cmap=cmap, vmin=np.nanmin(data), vmax=np.nanmax(data))
    ax.set_xticks(range(len(cols) + 1), [c if c == "alone" else f"+{c}" for c in cols] + ["average"])
    ax.set_yticks(range(len(rows)), [r for r, _ in rows])
    for i in range(data.shape[0]):
        for j in range(data.shape[1]):
            if data[i, j] == data[i, j]:
                ax.text(j, i, f"{data[i, j]:.2f}", ha="center", va="center", fontsize=7, color="w")
    ax.set_title(f"Transfer ASR, composites (ResNet-20 -> 5 targets, {n} images)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    fig.savefig(path)


def write(md, lines):
    with open(md, "a") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("all", "fidelity", "timing", "direction", "composites"), default="all")
    ap.add_argument("--timing-n", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", nargs="*", help="only these attacks (fidelity, timing: the labels; direction: recipes, i_fgsm always run)")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seeds", type=int, default=1, help="fidelity: run both sides once per seed, compare means")
    ap.add_argument("--composite-n", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--norm", choices=("linf", "l2"), default="linf",
                    help="direction: the threat (l2: eps 1, step 0.1, Table VII CIFAR-10)")
    ap.add_argument("--md", default=str(HERE / "transfer_fidelity.md"))
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="keep (as `blackboxbench run`): glibc keeps freed memory, for both sides of every "
                         "comparison (the process is shared); default: glibc's own settings")
    args = ap.parse_args()
    if args.malloc == "keep":
        keep_freed_memory()
    torch.set_num_threads(args.threads)
    root = os.environ.get("BLACKBOXBENCH_DATA", str(HERE.parent.parent / "shared" / "data"))
    ds = DATASET.get("cifar10")(root, n=args.n, file="cifar10/cifar10_test_first100.npz")
    x, y = ds.x, ds.y
    pool = Pool(x, y)
    surrogate = build_model("cifar_resnet20", root)
    models = {name: build_model(name, root) for name in TARGETS}
    if args.part in ("all", "fidelity"):
        fidelity(models, surrogate, x, y, pool, args.md, only=args.only, seeds=args.seeds)
    if args.part in ("all", "timing"):
        k = args.timing_n
        timing(surrogate, x[:k], y[:k], pool, args.md, repeats=args.repeats, only=args.only, malloc=args.malloc)
    if args.part in ("all", "direction"):
        direction(models, surrogate, x, y, pool, args.md, only=args.only and set(args.only) | {"i_fgsm"},
                  norm=args.norm)
    if args.part in ("all", "composites"):
        k = args.composite_n
        composites(models, surrogate, x[:k], y[:k], Pool(x, y), HERE / "transfer_composites.csv",
                   HERE / "transfer_composites.png", args.md)


if __name__ == "__main__":
    sys.exit(main())
