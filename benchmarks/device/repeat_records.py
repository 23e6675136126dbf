"""Run each given run twice on one device with the same seed and compare the records: on a deterministic path they
are identical (wall time and checksum aside). On CUDA this checks the per-sample sums of the decision estimates
(``query/common.py``, ``add_rows_``: HSJA, GeoDA, QEBA, the learned priors), which CUDA's ``index_add_`` made
differ from run to run; prints one row per run as it finishes.

    python benchmarks/device/repeat_records.py --device cuda --n 16 hsja_linf:linf:0.03 geoda_linf:linf:0.03

Runs are ``attack:norm:eps`` on the first ``--n`` CIFAR-10 test images against ResNet-20 (the data root's), budget
``--budget``. Exit status 1 when a run's records differ or a run fails.

``--batch-sizes 16,5`` runs the two repetitions at those batch sizes (default: both at ``--n``) and ``--fixed-batch
k`` sets the config's ``fixed_batch``: with both, the records must still be identical (README, "fixed_batch");
``--control`` reports the differing records without failing (the same runs without ``fixed_batch``).

``--surrogates a,b`` gives the runs white-box surrogates (a query run's, e.g. ``prgf``); with ``--targets c,d`` the
runs are transfer runs (``mi_fgsm:linf:0.03``: surrogates crafting, the targets judging; no query budget).
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from blackboxbench.config import load_config  # noqa: E402
from blackboxbench.runner import Session, run_experiment  # noqa: E402

VOLATILE = ("time", "check")  # a record's wall time, and the checksum that covers it


def records(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in rows), key=lambda r: r["index"])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="attack:norm:eps")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--budget", type=int, default=10_000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch-sizes", default=None, help="a,b: the two repetitions' batch sizes (default n,n)")
    ap.add_argument("--fixed-batch", type=int, default=None)
    ap.add_argument("--control", action="store_true", help="report differences without failing")
    ap.add_argument("--surrogates", default=None, help="a,b: white-box surrogates of every run")
    ap.add_argument("--targets", default=None, help="c,d: transfer runs judged on these targets")
    args = ap.parse_args(argv)
    sizes = [int(b) for b in args.batch_sizes.split(",")] if args.batch_sizes else [args.n, args.n]
    out = Path(args.out or tempfile.mkdtemp(prefix="bbb_repeat_"))
    session, bad = Session(), 0
    print("| run | n | batch sizes | fixed_batch | records differing | seconds (first, second) | ok |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for spec in args.runs:
        attack, norm, eps = spec.split(":")
        config = {"dataset": {"name": "cifar10", "n": args.n}, "model": "cifar_resnet20", "device": args.device,
                  "seed": 0, "attack": attack, "threat": {"norm": norm, "eps": eps, "max_queries": args.budget}}
        if args.surrogates:
            config["surrogates"] = args.surrogates.split(",")
        if args.targets:  # a transfer run: no target behind an oracle, no budget
            del config["model"], config["threat"]["max_queries"]
            config["targets"] = args.targets.split(",")
        if args.fixed_batch:
            config["fixed_batch"] = args.fixed_batch
        path = out / f"{attack}_{norm}.yaml"
        path.write_text(yaml.safe_dump(config))
        seen, seconds, error = [], [], None
        for rep in range(2):
            exp = load_config(path, [f"output_dir={out / f'rep{rep}'}", f"batch_size={sizes[rep]}"])[0][0]
            t0 = time.perf_counter()
            try:
                run_dir, _ = run_experiment(exp, session=session, fresh=True, progress=False)
            except Exception as e:  # noqa: BLE001 -- a failed run is a row saying so
                error = f"{type(e).__name__}: {e}"
                break
            seconds.append(time.perf_counter() - t0)
            seen.append(records(run_dir))
        differing = "-" if error else sum(a != b for a, b in zip(*seen)) + abs(len(seen[0]) - len(seen[1]))
        ok = error is None and (differing == 0 or args.control)
        bad += not ok
        print(f"| {spec} | {args.n} | {sizes[0]}, {sizes[1]} | {args.fixed_batch or '-'} | {differing} | "
              f"{', '.join(f'{s:.1f}' for s in seconds)} | "
              f"{'yes' if ok else 'NO'}{f' ({error})' if error else ''} |", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
