"""Command line: ``blackboxbench run CONFIG [--set k=v ...]``, ``blackboxbench leaderboard DIR -o CSV``,
``blackboxbench robustness DIR -o CSV``, ``blackboxbench plot RESULTS -r RECIPE -o PNG``,
``blackboxbench analyze -r RECIPE --run RUN_DIR -o PNG``, ``blackboxbench compare RUN_A RUN_B``,
``blackboxbench list``. Errors caused by input print one line and exit with status 2."""
import argparse
import json
import math
import os
import sys
import warnings

from .errors import BenchError, one_line_warning

SUMMARY_FIELDS = [("label", "attack"), ("target_model", "target"), ("defense", "defense"), ("norm", "norm"),
                  ("eps", "eps"), ("targeted", "targeted"), ("n", "n"), ("clean_acc", "clean acc"), ("asr", "ASR"),
                  ("asr_interval", "ASR 95 %"), ("aqn", "AQN"), ("mqn", "MQN"), ("mean_linf", "mean Linf"),
                  ("mean_l2", "mean L2"), ("wall_time", "time s")]


def _count(n, noun):
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _cell(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def _value(row, key):
    """``row[key]``; a key ``<name>_interval`` reads ``<name>_low`` and ``<name>_high`` as the text ``low-high``,
    rounded outwards to 2 decimals (so the interval shown still holds the estimate shown: 0.3447 in 0.27-0.35)."""
    if not key.endswith("_interval"):
        return row.get(key)
    low, high = (row.get(f"{key[:-len('_interval')]}_{end}") for end in ("low", "high"))
    if not (isinstance(low, (int, float)) and isinstance(high, (int, float))):
        return None
    return f"{math.floor(low * 100 + 1e-9) / 100:.2f}-{math.ceil(high * 100 - 1e-9) / 100:.2f}"


def _fields(family):
    """The terminal table's (key, header) pairs of a family's runs: its declared ``table``, else the classification
    fields."""
    from .registry import FAMILY

    return (FAMILY.get(family).table if family in FAMILY else None) or SUMMARY_FIELDS


def format_table(rows):
    """Run summaries (or leaderboard rows) as text tables, one per family in order of first appearance."""
    groups = {}
    for r in rows:
        groups.setdefault(r.get("family"), []).append(r)
    from .leaderboard import SETTING_KEYS, run_labels

    out = []
    for family, group in groups.items():
        fields = _fields(family)
        shown = [k for k, _ in fields]
        # rows alike in every setting shown: their label names the hidden setting that differs (a success rule...)
        labels = run_labels(group, clash=lambda r: [r.get(k) for k in shown if k in SETTING_KEYS or k == "norm"],
                            keys=[k for k in SETTING_KEYS if k not in shown])
        head = [h for _, h in fields]
        body = [[_cell(name if k == "label" else _value(r, k)) for k, _ in fields] for r, name in zip(group, labels)]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out.append("\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body]))
    return "\n\n".join(out)


def cmd_run(args):
    from .config import load_config
    from .errors import ConfigError
    from .leaderboard import export_csv
    from .runner import Session, run_all
    from .sweep import check_backend, run_sweep

    if args.threads is not None:
        if args.threads < 1:
            raise BenchError(f"--threads must be >= 1 (CPU threads of this process), got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    if args.malloc == "keep":
        from .malloc import keep_freed_memory
        keep_freed_memory()
    experiments, opts = load_config(args.config, args.set)
    backend = opts["backend"]
    if args.workers and not args.backend and backend["name"] == "serial":
        args.backend = "processes"  # --workers asks for parallel runs: of a serial config, in worker processes
        print(f"--workers {args.workers}: the config's backend is serial; running on backend processes",
              file=sys.stderr)
    if args.backend or args.workers or args.threads:
        name = args.backend or backend["name"]
        keep = {k: v for k, v in backend.items() if name != "serial" or k in ("name", "threads")}  # filled defaults
        over = {"name": name, **({"workers": args.workers} if args.workers else {}),
                **({"threads": args.threads} if args.threads else {})}
        backend = check_backend({**keep, **over}, "command line")
    runners = [_runner(e, i, len(experiments), args) for i, e in enumerate(experiments)]  # validate all first
    share = args.share_forwards or opts.get("share_forwards", False)
    if opts.get("cascade"):
        from .runner import link_cascade
        if share or backend["name"] != "serial":
            raise BenchError("cascade runs the runs one after another, in the file's order: not with "
                             "--share-forwards, --workers or --backend")
        link_cascade(runners)
    if backend["name"] == "serial":
        summaries = run_all(runners, Session(), share, lambda r: print(f"run {r.run_dir}", file=sys.stderr))
    elif share:
        raise ConfigError("--share-forwards needs the runs in one process: backend serial", args.config)
    else:
        print(f"{len(experiments)} runs on backend {backend['name']}", file=sys.stderr)
        summaries = run_sweep(experiments, backend, args.fresh, lambda d: print(f"run {d}", file=sys.stderr))
    print(format_table(summaries))
    results = sorted({e["output_dir"] for e in experiments})
    if opts.get("leaderboard"):
        from .leaderboard import notes
        rows, skipped = export_csv(results, opts["leaderboard"])
        print(f"leaderboard: {opts['leaderboard']} ({_count(len(rows), 'run')})")
        for line in notes(rows, skipped, opts["leaderboard"]):
            print(line, file=sys.stderr)
        _family_reports({r.family.name for r in runners}, results, opts["leaderboard"])
    if opts.get("robustness"):
        _robustness(results, opts["robustness"])
    for p in opts.get("plots") or []:
        from .analysis.recipes import plot
        png, table, n, _ = plot(p["recipe"], results, p["output"], p["params"], p["where"],
                                setter=f"{args.config} (plots)")
        print(f"plot {p['recipe']}: {png} and {table} ({_count(n, 'result row')})")
    return 0


def _runner(exp, i, n, args):
    """The Runner of experiment ``i`` of ``n``; a config error in one run of several says which run."""
    from .errors import ConfigError
    from .runner import Runner

    try:
        return Runner(exp, fresh=args.fresh, progress=not args.quiet)
    except ConfigError as e:
        if n == 1:
            raise
        attack = exp["attack"]
        name = attack if isinstance(attack, str) else attack.get("recipe") or attack.get("name")
        raise BenchError(f"{e} (in run {i + 1} of {n}: attack {name})") from None


def _robustness(results, out):
    from . import worst_case
    from .robustness import chart_path, export
    png = str(chart_path(out))
    rows, skipped = export(results, out, png)
    if rows:
        print(f"robustness leaderboard: {out} and {png} ({_count(len(rows), 'query run')})")
    else:
        print(f"robustness leaderboard: {out} (0 query runs)")
        print(f"note: no finished query run; {out} holds only the header and no chart was drawn", file=sys.stderr)
    for s in skipped:
        print(str(s), file=sys.stderr)
    worst = worst_case.worst_case_path(out)
    groups, left_out = worst_case.export(results, worst)
    for s in left_out:
        print(str(s), file=sys.stderr)
    print(f"worst case per sample: {worst} ({_count(len(groups), 'group')} of runs on the same images and threat)")
    for g in groups:
        if g["robust_acc"] is not None and g["n_runs"] > 1:
            best = "" if g["best_run"] is None else \
                f"; the best alone ({g['best_run']}) leaves {g['clean_acc'] * (1 - (g['best_asr'] or 0)):.3f}"
            threat = "".join([f" targeted ({g['target_label']})" if g["targeted"] else "",
                              f" {g['budget']} queries" if g["budget"] else "",
                              f" {g['success_rule']}" if g["success_rule"] not in (None, "single") else ""])
            data = g["dataset"] + (f" ({g['dataset_params']})" if g["dataset_params"] else "")
            print(f"  {data}: {g['target_model']} ({g['defense'] or 'none'}) {g['norm']} {g['eps']:.4g}{threat}: "
                  f"robust accuracy {g['robust_acc']:.3f} ({g['robust_acc_low']:.3f}-{g['robust_acc_high']:.3f}) under "
                  f"{g['n_runs']} runs{' (cascade)' if g['cascade'] else ''} on {g['n']} images{best}")


def cmd_robustness(args):
    _robustness(args.results, args.output)
    return 0


def _family_reports(families, results, board):
    """Each family's own reports next to the leaderboard ``board`` (the detection CSV and heatmaps)."""
    from .registry import FAMILY
    for name in sorted(n for n in families if isinstance(n, str) and n in FAMILY):
        for path in FAMILY.get(name).after_runs(results, board):
            print(f"{name} report: {path}")


def cmd_leaderboard(args):
    from .leaderboard import export_csv, notes
    rows, skipped = export_csv(args.results, args.output)
    print(format_table(rows))
    print(f"leaderboard: {args.output} ({_count(len(rows), 'run')})")
    for line in notes(rows, skipped, args.output):
        print(line, file=sys.stderr)
    _family_reports({r.get("family") for r in rows}, args.results, args.output)
    return 0


def cmd_compare(args):
    from .compare import compare_runs, format_comparison
    result = compare_runs(args.run_a, args.run_b)
    print(json.dumps(result, indent=2) if args.json else "\n".join(format_comparison(result)))
    return 0


def _assignments(items, flag):
    """``--flag key=value`` items -> {key: value}; a value reads as YAML, then as arithmetic (``8/255``)."""
    from .config import parse_number, parse_yaml
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise BenchError(f"{flag} expects key=value, got {item!r}")
        value = parse_yaml(raw, flag, key, what=f"{flag} value is not valid YAML")
        if isinstance(value, str):
            try:
                value = parse_number(value)
            except ValueError:
                pass
        out[key.strip()] = value
    return out


def _plugins(args):
    from .config import import_plugins
    import_plugins(args.plugin, "command line (--plugin)", os.getcwd())


def cmd_plot(args):
    from .analysis.recipes import plot
    _plugins(args)
    params = {k: v for k, v in (("x", args.x), ("y", args.y), ("hue", args.hue), ("size", args.size)) if v is not None}
    params.update(_assignments(args.param, "--param"))
    png, table, n, skipped = plot(args.recipe, args.results, args.output, params, _assignments(args.where, "--where"))
    print(f"{args.recipe}: {png} and {table} ({_count(n, 'result row')})")
    for s in skipped:
        print(str(s), file=sys.stderr)
    return 0


def _yaml_arg(text, flag):
    from .config import parse_yaml
    return None if text is None else parse_yaml(text, flag, what=f"{flag} is not valid YAML")


def cmd_analyze(args):
    from .analysis.recipes import analyze
    from .config import DEVICES
    from .runner import resolve_device
    _plugins(args)
    if args.device not in DEVICES:
        raise BenchError(f"--device must be one of {', '.join(DEVICES)}, got {args.device!r}")
    try:
        indices = None if args.indices is None else [int(i) for i in args.indices.split(",")]
    except ValueError:
        raise BenchError(f"--indices expects comma-separated integers, got {args.indices!r}") from None
    if args.n is not None and args.n < 1:
        raise BenchError(f"--n must be >= 1 (the first n images), got {args.n}")
    if not 0 <= args.seed < 1 << 63:
        raise BenchError(f"--seed must be in [0, 2**63), got {args.seed}")
    try:
        png, table, npz, n, loaded = analyze(args.recipe, args.output, _assignments(args.param, "--param"),
                                     resolve_device(args.device), run=args.run, model=_yaml_arg(args.model, "--model"),
                                     dataset=_yaml_arg(args.dataset, "--dataset"), data_root=args.data_root, n=args.n,
                                     indices=indices, seed=args.seed)
    except BenchError as e:  # the loaders' wording names a config's data_root; this command has its flag
        if args.data_root is None and str(e).startswith("no data root"):
            raise BenchError("no data root: give --data-root or set BLACKBOXBENCH_DATA") from None
        raise
    print(f"{args.recipe}: {png}, {table} and {npz} ({_count(n, 'image')})")
    if n < loaded:
        print(f"note: {args.recipe} draws its first max_images={n} of the {loaded} images loaded; --param "
              f"max_images={loaded} draws them all", file=sys.stderr)
    return 0


def cmd_list(args):
    from . import catalog, registry
    from .config import load_yaml
    if args.what == "attacks":
        for name, path in catalog.entries("attacks").items():
            r = load_yaml(path)
            print(f"{name:24s} {r.get('family', '?'):9s} {','.join(r.get('norms', [])):8s} {r.get('paper', '')}")
    elif args.what == "analysis":
        for name, path in catalog.entries("analysis").items():
            r = load_yaml(path)
            print(f"{name:24s} {r.get('tool', '?'):14s} {r.get('params', '')}")
    elif args.what == "defenses":  # registry entries, no YAML recipes (defenses/README.md)
        for name in registry.DEFENSE.names():
            fn = registry.DEFENSE.get(name)
            print(f"{name:24s} {registry.block_params(fn)} {fn.registry_meta.get('paper', '')}")
    else:
        for reg in (v for v in vars(registry).values() if isinstance(v, registry.Registry)):
            print(f"{reg.kind}: {', '.join(reg.names())}")
    return 0


def build_parser():
    """The command line's parser (its subcommands and flags; tests/test_readme.py holds README.md to it)."""
    from . import __version__
    parser = argparse.ArgumentParser(prog="blackboxbench", description=__doc__)
    parser.add_argument("--version", action="version", version=f"blackboxbench {__version__}")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the experiment(s) of a YAML config (resumes an interrupted run)")
    p.add_argument("config", help="a YAML config (its output paths are relative to the working directory)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (dotted: threat.eps=4/255; the whole-file keys too: leaderboard=b.csv, "
                        "grid.threat.eps=[...], backend.name=processes); output_dir=D moves the board and plots into D")
    p.add_argument("--fresh", action="store_true", help="discard earlier results of the same config")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory for the next step (about 10x fewer page faults; "
                        "blackboxbench/malloc.py); default: leave glibc's settings")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads of this process and of each worker of a processes or ray backend (default: "
                        "torch's, one per core; a worker's: the backend's threads, 1). On a machine where other "
                        "processes keep cores busy, use the free ones: OpenMP's busy-waiting threads then wait for "
                        "each other (a CIFAR-10 run measured 13x slower with 2 threads beside another process)")
    p.add_argument("--share-forwards", action="store_true",
                   help="runs on the same target model take turns and share its forwards (the config's "
                        "share_forwards; blackboxbench/shared.py)")
    p.add_argument("--backend", choices=("serial", "processes", "ray"), default=None,
                   help="where the runs execute (the config's backend; blackboxbench/sweep.py): one after another "
                        "here, in worker processes of this machine, or as tasks of a Ray cluster")
    p.add_argument("--workers", type=int, default=None, help="worker processes (backend processes; ray: started "
                                                             "locally when no cluster address is given)")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("leaderboard", help="export every run under a results directory as one CSV")
    p.add_argument("results", help="a results directory (every run folder under it)")
    p.add_argument("-o", "--output", default="leaderboard.csv", help="the CSV (default: %(default)s)")
    p.set_defaults(fn=cmd_leaderboard)
    p = sub.add_parser("compare", help="two runs on the same images, paired: who fooled which samples (McNemar) "
                                       "and who needed fewer queries on the samples both fooled (sign test)")
    p.add_argument("run_a", help="a run directory")
    p.add_argument("run_b", help="a run directory of the same dataset and family")
    p.add_argument("--json", action="store_true", help="the numbers as JSON")
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("robustness", help="ASR and mean queries per attack x defense: a CSV and a PNG chart, and "
                                          "the worst case per sample over the attacks (<output>_worst_case.csv)")
    p.add_argument("results", help="a results directory (its query runs)")
    p.add_argument("-o", "--output", default="robustness.csv",
                   help="the CSV; the chart and <output>_worst_case.csv go next to it (default: %(default)s)")
    p.set_defaults(fn=cmd_robustness)
    text = ("an analysis figure (aev_line, aev_scatter, aev_bar, aev_bubble, aev_heatmap) of a leaderboard CSV or a "
            "results directory: a PNG and its numbers as CSV")
    p = sub.add_parser("plot", help=text, description=text)
    p.add_argument("results", help="a leaderboard CSV or a results directory")
    p.add_argument("-r", "--recipe", required=True, help="an analysis recipe (blackboxbench list analysis) or .yaml")
    p.add_argument("-o", "--output", default="plot.png",
                   help="the figure; its numbers go next to it as .csv (default: %(default)s)")
    for key in ("x", "y", "hue", "size"):
        p.add_argument(f"--{key}", default=None, help=f"the column for {key} (overrides the recipe)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="any other tool parameter")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="import a plugin first (its analysis tools, for a recipe that names one)")
    p.add_argument("--where", action="append", default=[], metavar="COLUMN=VALUE",
                   help="keep the rows with this value (the fixed components; e.g. norm=linf, eps=8/255)")
    p.set_defaults(fn=cmd_plot)
    text = ("a model-level analysis (decision_surface, dbviz, fsm, fullgrad, fullgrad_path, path_tsne, adm) of a "
            "run's images or of a model and a dataset: a PNG, its numbers as CSV, arrays as NPZ")
    p = sub.add_parser("analyze", help=text, description=text)
    p.add_argument("-r", "--recipe", required=True, help="an analysis recipe (blackboxbench list analysis) or .yaml")
    p.add_argument("--run", default=None, help="a run directory (its config names the dataset and model; with "
                                                 "save_adv: true its adversarial images are read too)")
    p.add_argument("--model", default=None, help="a model spec (YAML: a name or {name: ..., ...}); overrides the run's")
    p.add_argument("--dataset", default=None, help="a dataset spec (YAML); overrides the run's")
    p.add_argument("--data-root", default=None, help="the data root (default: the run's, else BLACKBOXBENCH_DATA)")
    p.add_argument("--n", type=int, default=None, help="the first n images (of the run's saved ones)")
    p.add_argument("--indices", default=None, help="comma-separated dataset indices")
    p.add_argument("--seed", type=int, default=0, help="seed of random directions (a run's own seed wins)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a tool parameter")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="import a plugin first (an analysis tool, a dataset or model it registers; a run's own "
                        "plugins are imported by --run)")
    p.add_argument("-o", "--output", default="analysis.png",
                   help="the figure; .csv and .npz go next to it (default: %(default)s)")
    p.set_defaults(fn=cmd_analyze)
    p = sub.add_parser("list", help="list the attack, defense or analysis catalog, or the registered blocks")
    p.add_argument("what", choices=("attacks", "defenses", "analysis", "blocks"), nargs="?", default="attacks",
                   help="the catalog or registry to list (default: %(default)s)")
    p.set_defaults(fn=cmd_list)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        import blackboxbench  # noqa: F401  (registers every block)
        shown = warnings.formatwarning
        warnings.formatwarning = one_line_warning  # a library warning printed: one line too, as the errors
        try:
            return args.fn(args)
        finally:
            warnings.formatwarning = shown
    except BenchError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)  # one line, whatever the message holds
        return 2
    except BrokenPipeError:  # e.g. `blackboxbench list | head`
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("interrupted: re-run the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
