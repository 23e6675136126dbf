"""Every run of the given configs on the first ``--n`` images, once with ``device: cpu`` and once with
``device: cuda``; prints one row per run as it finishes: ASR on each device and the difference in points
(the issue's bar: within 3 points). Results go to a temporary folder (or ``--out``).

    python benchmarks/device/asr_cuda_vs_cpu.py configs/cifar10_query_all.yaml configs/cifar10_transfer.yaml --n 32
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from blackboxbench.config import load_config  # noqa: E402
from blackboxbench.runner import Session, run_experiment  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-diff", type=float, default=3.0, help="points of ASR allowed between devices")
    ap.add_argument("--first", default="", help="comma-separated attacks to run before the others (those that a "
                    "time limit must not cut, e.g. the decision attacks of the issue)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bbb_asr_"))
    devices = args.devices.split(",")
    print(f"| config | run | {' | '.join(f'{d} ASR' for d in devices)} | diff (points) | "
          f"{' | '.join(f'{d} s' for d in devices)} | ok |", flush=True)
    print("|---" * (3 + 2 * len(devices)) + "|---|", flush=True)
    sessions = {d: Session() for d in devices}
    first = [a for a in args.first.split(",") if a]
    runs = [(cfg, exp) for cfg in args.configs
            for exp in load_config(cfg, [f"dataset.n={args.n}", f"output_dir={out}"])[0]]
    runs.sort(key=lambda run: first.index(run[1]["attack"]) if run[1]["attack"] in first else len(first))
    bad = 0
    for cfg, exp in runs:
        asr, took = [], []
        for d in devices:
            e = dict(exp, device=d)
            t0 = time.perf_counter()
            _, summary = run_experiment(e, session=sessions[d], fresh=True, progress=False)
            took.append(time.perf_counter() - t0)
            asr.append(summary["asr"] or 0.0)
        diff = 100 * (max(asr) - min(asr))
        ok = diff <= args.max_diff
        bad += not ok
        name = f"{summary['attack']} {summary['norm']} {summary['eps']:.4g}"
        print(f"| {Path(cfg).name} | {name} | {' | '.join(f'{a:.3f}' for a in asr)} | {diff:.1f} | "
              f"{' | '.join(f'{t:.1f}' for t in took)} | {'yes' if ok else 'NO'} |", flush=True)
    print(f"{bad} run(s) differ by more than {args.max_diff} points", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
