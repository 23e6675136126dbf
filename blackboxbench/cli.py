"""Command line: ``blackboxbench run CONFIG [--set k=v ...]``, ``blackboxbench leaderboard DIR -o CSV``,
``blackboxbench robustness DIR -o CSV``, ``blackboxbench list``. Errors caused by input print one line and exit
with status 2."""
import argparse
import os
import sys
from pathlib import Path

from .errors import BenchError

SUMMARY_FIELDS = [("attack", "attack"), ("target_model", "target"), ("defense", "defense"), ("norm", "norm"),
                  ("eps", "eps"), ("targeted", "targeted"), ("n", "n"), ("clean_acc", "clean acc"), ("asr", "ASR"),
                  ("aqn", "AQN"), ("mqn", "MQN"), ("mean_linf", "mean Linf"), ("mean_l2", "mean L2"),
                  ("wall_time", "time s")]


def _cell(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


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
    out = []
    for family, group in groups.items():
        fields = _fields(family)
        head = [h for _, h in fields]
        body = [[_cell(r.get(k)) for k, _ in fields] for r in group]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        out.append("\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body]))
    return "\n\n".join(out)


def cmd_run(args):
    from .config import load_config
    from .leaderboard import export_csv
    from .runner import Runner, Session, run_all

    if args.malloc == "keep":
        from .malloc import keep_freed_memory
        keep_freed_memory()
    experiments, opts = load_config(args.config, args.set)
    runners = [Runner(e, fresh=args.fresh, progress=not args.quiet) for e in experiments]  # validate all first
    share = args.share_forwards or opts.get("share_forwards", False)
    summaries = run_all(runners, Session(), share, lambda r: print(f"run {r.run_dir}", file=sys.stderr))
    print(format_table(summaries))
    if opts.get("leaderboard"):
        from .leaderboard import notes
        rows, skipped = export_csv(sorted({e["output_dir"] for e in experiments}), opts["leaderboard"])
        print(f"leaderboard: {opts['leaderboard']} ({len(rows)} runs)")
        for line in notes(rows, skipped, opts["leaderboard"]):
            print(line, file=sys.stderr)
        for fam in {r.family.name: r.family for r in runners}.values():
            for path in fam.after_runs(sorted({e["output_dir"] for e in experiments}), opts["leaderboard"]):
                print(f"{fam.name} report: {path}")
    if opts.get("robustness"):
        _robustness(sorted({e["output_dir"] for e in experiments}), opts["robustness"])
    return 0


def _robustness(results, out):
    from .robustness import export
    png = str(Path(out).with_suffix(".png"))
    rows, skipped = export(results, out, png)
    print(f"robustness leaderboard: {out} and {png} ({len(rows)} query runs)")
    for s in skipped:
        print(str(s), file=sys.stderr)


def cmd_robustness(args):
    _robustness(args.results, args.output)
    return 0


def cmd_leaderboard(args):
    from .leaderboard import export_csv, notes
    rows, skipped = export_csv(args.results, args.output)
    print(format_table(rows))
    print(f"leaderboard: {args.output} ({len(rows)} runs)")
    for line in notes(rows, skipped, args.output):
        print(line, file=sys.stderr)
    return 0


def cmd_list(args):
    from . import catalog, registry
    from .config import load_yaml
    if args.what == "attacks":
        for name, path in catalog.entries("attacks").items():
            r = load_yaml(path)
            print(f"{name:24s} {r.get('family', '?'):9s} {','.join(r.get('norms', [])):8s} {r.get('paper', '')}")
    else:
        for reg in (v for v in vars(registry).values() if isinstance(v, registry.Registry)):
            print(f"{reg.kind}: {', '.join(reg.names())}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="blackboxbench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("run", help="run the experiment(s) of a YAML config (resumes an interrupted run)")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--fresh", action="store_true", help="discard earlier results of the same config")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory for the next step (about 10x fewer page faults; "
                        "blackboxbench/malloc.py); default: leave glibc's settings")
    p.add_argument("--share-forwards", action="store_true",
                   help="runs on the same target model take turns and share its forwards (the config's "
                        "share_forwards; blackboxbench/shared.py)")
    p.set_defaults(fn=cmd_run)
    p = sub.add_parser("leaderboard", help="export every run under a results directory as one CSV")
    p.add_argument("results")
    p.add_argument("-o", "--output", default="leaderboard.csv")
    p.set_defaults(fn=cmd_leaderboard)
    p = sub.add_parser("robustness", help="ASR and mean queries per attack x defense: a CSV and a PNG chart")
    p.add_argument("results")
    p.add_argument("-o", "--output", default="robustness.csv")
    p.set_defaults(fn=cmd_robustness)
    p = sub.add_parser("list", help="list the attack catalog or the registered blocks")
    p.add_argument("what", choices=("attacks", "blocks"), nargs="?", default="attacks")
    p.set_defaults(fn=cmd_list)
    args = parser.parse_args(argv)
    try:
        import blackboxbench  # noqa: F401  (registers every block)
        return args.fn(args)
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
