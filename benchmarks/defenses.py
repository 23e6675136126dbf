"""Defense benchmarks on CIFAR-10 / ResNet-20 (data root from BLACKBOXBENCH_DATA).

Sections (``--only`` runs one; otherwise all run; each prints a markdown table, appended to ``--out``):

* ``aaa_cost``: the AAA wrapper's cost per query (100 Adam steps on the logits): wall time of one oracle call of
  ``--batch`` images through AAA-Linear / AAA-Sine / RND / JPEG, as a multiple of the undefended oracle call
  (median of ``--repeats``). Target: AAA <= 1.5x at batch 100.
* ``jpeg_art``: Square Linf (eps 0.03, ``--budget`` queries) against JPEG quality 75: ours (recipe
  ``square_linf``, ``defense: jpeg``) vs ART's ``SquareAttack`` on a ``PyTorchClassifier`` with ART's
  ``JpegCompression`` preprocessor; ASR judged by each library's own defended model on its returned image.
  Target: within 5 pp.
* ``aaa_decision``: why decision attacks move under AAA: ``--attacks`` (default hsja_linf, rays; Linf 8/255,
  ``--budget`` queries, the first ``--n`` images) against no defense, AAA-Linear with 0 Adam steps (only its
  ``floor(255 x) / 255`` input quantization), AAA-Linear and AAA-Sine.
* ``board``: runs of ``configs/cifar10_defenses.yaml`` (``--attacks`` keeps a subset, ``--set`` overrides keys,
  e.g. ``--set dataset.n=16``; ``--export-only`` only reads ``--board-dir``), then the robustness leaderboard (CSV
  and PNG), a pivot of ASR (mean queries) per attack x defense, the claims per attack family, and the wall time.

Run: ``python benchmarks/defenses.py --threads 1`` (about 10 minutes on a loaded 2-core CPU with the defaults).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

from blackboxbench.defense import DEFENSE, DefendedTarget, defense_streams  # noqa: E402
from blackboxbench.oracle import Oracle  # noqa: E402
from blackboxbench.prep.data import resolve_data_root  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.registry import DATASET  # noqa: E402
from blackboxbench.robustness import short_defense  # noqa: E402

SECTIONS = ("aaa_cost", "jpeg_art", "aaa_decision", "board")


def table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def section_aaa_cost(args, ctx):
    model, x = ctx["m20"], ctx["data"].x[:args.batch]
    n = x.shape[0]
    who = torch.arange(n)

    def oracle(defenses):
        target = DefendedTarget(model, defenses, defense_streams(0, n, "cpu")) if defenses else None
        return Oracle(model, n, 10 ** 9, 10, "score", x.shape[1:], defense=target)

    def timed(o):
        o(x, who)  # warm-up
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            o(x, who)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    base = timed(oracle([]))
    rows = [("none", f"{base * 1000:.1f}", "1.00x")]
    for name in ("aaa_linear", "aaa_sine", "rnd", "jpeg"):
        t = timed(oracle([DEFENSE.get(name)()]))
        rows.append((name, f"{t * 1000:.1f}", f"{t / base:.2f}x"))
    return (f"AAA cost per query: one oracle call of {n} CIFAR-10 images on ResNet-20 (median of {args.repeats}, "
            f"{torch.get_num_threads()} thread(s))\n\n" + table(("defense", "ms per call", "vs undefended"), rows))


def _build(name, eps, budget):
    from blackboxbench.builder import build_attack, load_recipe, recipe_family
    from blackboxbench.config import finish_threat

    recipe, source = load_recipe(name, "benchmark")
    t = finish_threat({"norm": "linf", "eps": eps, "max_queries": budget}, recipe, recipe_family(recipe, source),
                      source)
    return build_attack(recipe, t, source), t


def section_jpeg_art(args, ctx):
    from art.attacks.evasion import SquareAttack
    from art.defences.preprocessor import JpegCompression
    from art.estimators.classification import PyTorchClassifier

    from blackboxbench.defense import jpeg
    from blackboxbench.runner import run_tensors

    model, data = ctx["m20"], ctx["data"]
    x, y = data.x[:args.n], data.y[:args.n]
    with torch.no_grad():
        keep = model(jpeg(x)).argmax(1) == y  # images the defended model classifies correctly
    x, y = x[keep], y[keep]
    eps = 0.03
    attack, threat = _build("square_linf", eps, args.budget)
    t0 = time.perf_counter()
    records = run_tensors(attack, threat, x, y, {"model": [model]}, seed=args.seed,
                          defenses={"model": [[DEFENSE.get("jpeg")()]]})
    ours_wall = time.perf_counter() - t0
    ours = sum(r["success"] for r in records if r["attacked"])
    attacked = sum(r["attacked"] for r in records)
    x_ours = torch.stack([r.get("x_adv", x[r["index"]]) for r in records])
    with torch.no_grad():
        ours_check = int((model(jpeg(x_ours)).argmax(1) != y).sum())

    jpeg_art = JpegCompression(clip_values=(0.0, 1.0), quality=75, channels_first=True, apply_fit=False,
                               apply_predict=True)
    clf = PyTorchClassifier(model=model, loss=nn.CrossEntropyLoss(), input_shape=tuple(x.shape[1:]), nb_classes=10,
                            clip_values=(0.0, 1.0), preprocessing_defences=[jpeg_art])
    rows = [("ours (square_linf, defense jpeg; uint8 outputs: radius 7/255)", attacked,
             f"{ours}/{attacked} = {ours / attacked:.1%}", f"{ours_check}", f"{ours_wall:.0f}")]
    gaps = []
    # ART's eps 0.03 (7.65/255, float outputs) and, with --art-grid, 7/255: the radius our uint8 outputs reach.
    for art_eps in (eps, 7 / 255) if args.art_grid else (eps,):
        np.random.seed(args.seed)
        atk = SquareAttack(clf, norm=np.inf, max_iter=args.budget, eps=art_eps, p_init=0.05, nb_restarts=1,
                           verbose=False)
        t0 = time.perf_counter()
        x_art = atk.generate(x.numpy(), y=y.numpy())
        art_wall = time.perf_counter() - t0
        art = int((clf.predict(x_art).argmax(1) != y.numpy()).sum())
        rows.append((f"ART SquareAttack + JpegCompression(75), eps {art_eps * 255:.2f}/255", len(y),
                     f"{art}/{len(y)} = {art / len(y):.1%}", "-", f"{art_wall:.0f}"))
        gaps.append(f"{abs(ours / attacked - art / len(y)) * 100:.1f} pp at eps {art_eps * 255:.2f}/255")
    return (f"Square Linf 0.03 against JPEG quality 75, {args.budget} queries, the first {args.n} CIFAR-10 images "
            f"(those the JPEG-defended ResNet-20 classifies correctly: {len(y)}); seed {args.seed}\n\n"
            + table(("run", "attacked", "ASR", "adv. under our JPEG (re-check)", "wall s"), rows)
            + f"\n\nASR gap: {'; '.join(gaps)} (target <= 5 pp)")


def section_aaa_decision(args, ctx):
    from blackboxbench.runner import run_tensors

    model, data = ctx["m20"], ctx["data"]
    x, y = data.x[:args.n], data.y[:args.n]
    variants = [("none", None), ("quantization only (aaa_linear, 0 steps)", ("aaa_linear", {"iterations": 0})),
                ("aaa_linear", ("aaa_linear", {})), ("aaa_sine", ("aaa_sine", {}))]
    rows = []
    for name in (args.attacks or "hsja_linf,rays").split(","):
        attack, threat = _build(name, 8 / 255, args.budget)
        for label, d in variants:
            defenses = None if d is None else {"model": [[DEFENSE.get(d[0])(**d[1])]]}
            t0 = time.perf_counter()
            rec = [r for r in run_tensors(attack, threat, x, y, {"model": [model]}, seed=args.seed,
                                          defenses=defenses) if r["attacked"]]
            ok = [r["queries"] for r in rec if r["success"]]
            rows.append((name, label, f"{len(ok)}/{len(rec)}", f"{statistics.mean(ok):.0f}" if ok else "-",
                         f"{time.perf_counter() - t0:.0f}"))
            print("  " + " | ".join(rows[-1]), flush=True)
    return (f"Decision attacks under AAA: Linf 8/255, {args.budget} queries, the first {args.n} CIFAR-10 images "
            f"(ResNet-20), seed {args.seed}\n\n" + table(("attack", "defense", "successes", "AQN", "wall s"), rows))


def section_board(args, ctx):
    from blackboxbench.config import load_config
    from blackboxbench.robustness import export
    from blackboxbench.runner import Runner, Session

    cfg = REPO / "configs" / "cifar10_defenses.yaml"
    exps, opts = load_config(cfg, args.set + [f"output_dir={args.board_dir}"])
    if args.attacks:
        keep = set(args.attacks.split(","))
        exps = [e for e in exps if (e["attack"] if isinstance(e["attack"], str) else e["attack"]["recipe"]) in keep]
    session, t0 = Session(), time.perf_counter()
    runners = [Runner(e, session=session, progress=False) for e in exps]
    for r in [] if args.export_only else runners:
        s = r.run()
        print(f"  {s['attack']:14s} {s['defense'][:20]:20s} asr {s['asr']} aqn {s['aqn']} "
              f"({s['wall_time']:.0f} s)", flush=True)
    wall = time.perf_counter() - t0
    out = Path(args.board_dir) / "robustness.csv"
    every, _ = export(args.board_dir, out, out.with_suffix(".png"))  # the CSV and chart: every run, told apart
    # the tables below: only this invocation's runs (its configs and --set), never an older run of other settings
    wanted = {r.run_dir.name for r in runners}
    rows = [r for r in every if r["run"] in wanted]
    older = len(every) - len(rows)
    runs_s = sum(r["wall_time"] or 0.0 for r in rows)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    body = [(r["attack"], r["norm"], r["target_model"], short_defense(r["defense"]), f(r["clean_acc"], ".2f"),
             f(r.get("clean_acc_defended"), ".2f"), f(r["asr"], ".2f"),
             f(r["aqn"], ".0f"), f(r.get("mean_queries_all"), ".0f"), f(r.get("asr_reeval_defended"), ".2f"),
             f(r.get("asr_reeval_undefended"), ".2f"), f(r.get("mean_ssim"), ".3f")) for r in rows]
    return (f"Robustness leaderboard: {len(rows)} runs of configs/cifar10_defenses.yaml in {args.board_dir} with "
            f"{' '.join(args.set)} ({'attacks ' + args.attacks if args.attacks else 'every attack'}); wall "
            f"{wall:.0f} s here, {runs_s:.0f} s summed over the runs' own wall times; {out} and "
            f"{out.with_suffix('.png')}"
            + (f" (which also hold {older} older runs of other settings, left out of the tables below)" if older
               else "")
            + "\n\n"
            + table(("attack", "norm", "target", "defense", "clean acc", "clean acc def.", "ASR", "AQN",
                     "mean queries (all)", "ASR re-eval def. (maj. 5)", "ASR re-eval undef.", "mean SSIM"), body)
            + "\n\n" + board_pivot(rows) + "\n\n" + board_claims(rows))


BOARD_COLUMNS = ("none", "rnd", "aaa_linear", "aaa_sine", "at")


def board_pivot(rows):
    """ASR (mean queries over all attacked samples) per attack x defense: one line per attack."""
    cells = {(r["attack"], short_defense(r["defense"])): r for r in rows}
    body = []
    for attack in sorted({r["attack"] for r in rows}):
        line = [f"`{attack}`"]
        for d in BOARD_COLUMNS:
            r = cells.get((attack, d))
            line.append("-" if r is None else f"{r['asr']:.2f} ({r['mean_queries_all']:.0f})")
        body.append(line)
    return table(("attack", *BOARD_COLUMNS), body)


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def board_claims(rows):
    """The paper's defense claims (spec sheet section 7) read off the board, per attack family: mean ASR and mean
    queries over all attacked samples per defense, and the RND re-evaluation gap."""
    lines = []
    for family in sorted({r["family"] for r in rows}):
        fam = [r for r in rows if r["family"] == family]
        per = {d: [r for r in fam if short_defense(r["defense"]) == d] for d in BOARD_COLUMNS}
        stats = ", ".join(f"{d} {_mean([r['asr'] for r in per[d]]):.2f} / "
                          f"{_mean([r['mean_queries_all'] for r in per[d]]):.0f}" for d in BOARD_COLUMNS if per[d])
        lines.append(f"- {family} attacks ({len(per['none'])}), mean ASR / mean queries (all attacked): {stats}")
    rnd = [r for r in rows if short_defense(r["defense"]) == "rnd"]
    gap = sum(r["reeval_gap"] or 0 for r in rnd)
    recorded = sum(r["n_success"] for r in rnd)
    lines.append(f"- RND, one-draw policy: {recorded} recorded successes, {gap} of them not confirmed by the defended "
                 "majority of 5 (reeval_gap summed over the RND runs)")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=SECTIONS, action="append")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=100)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--budget", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attacks", default="")
    p.add_argument("--art-grid", action="store_true", help="jpeg_art: also ART at eps 7/255 (our uint8 radius)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--board-dir", default="results/defenses_bench")
    p.add_argument("--export-only", action="store_true", help="board: no runs, the tables of --board-dir's results")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    root = resolve_data_root(None)
    ctx = {"m20": build_model("cifar_resnet20", data_root=root), "data": DATASET.get("cifar10")(root)}
    impl = {"aaa_cost": section_aaa_cost, "jpeg_art": section_jpeg_art, "aaa_decision": section_aaa_decision,
            "board": section_board}
    for name in args.only or SECTIONS:
        text = f"### {name}\n\n`python benchmarks/defenses.py {' '.join(sys.argv[1:])}`\n\n" + impl[name](args, ctx)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
