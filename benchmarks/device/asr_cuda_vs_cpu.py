"""Every run of the given configs on the first ``--n`` images, once with ``device: cpu`` and once with
``device: cuda``; prints one row per run as soon as both of its sides are done: ASR on each device and the
difference in points (the issue's bar: within 3 points), and each side's seconds.

The CPU runs go to ``--cpu-workers`` worker processes (spawned) and the CUDA runs to ``--cuda-workers`` processes
(0: the main process), all at once; each worker builds one ``Session`` (its models are cached there) for all the
runs it gets. A CPU run gets ``--cpu-threads`` torch threads, or ``--wide-threads`` if it is one of ``--wide``
(the forward-heavy runs whose failing samples use the whole budget); runs are handed out while their threads fit
in ``--cpu-workers`` x ``--cpu-threads``. A run's seconds are therefore measured beside the other workers' runs
(its share of the cores and of the GPU, not the whole machine). ``--first`` runs are handed out first, in that
order; rows come in the order their runs finish. Results go to a temporary folder (or ``--out``).

    python benchmarks/device/asr_cuda_vs_cpu.py configs/cifar10_query_all.yaml configs/cifar10_transfer.yaml --n 32
"""
import argparse
import collections
import concurrent.futures as cf
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from blackboxbench.config import load_config  # noqa: E402
from blackboxbench.runner import Session, run_experiment  # noqa: E402

_SESSION = None  # one per worker process: its runs share its models


def _start_worker():
    global _SESSION
    _SESSION = Session()


def run_one(exp, session=None, threads=None):
    """One run in ``session`` (default: this worker's) with ``threads`` torch threads (default: as set); returns
    (ASR, seconds, row name, error or None)."""
    if threads:
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    try:
        _, summary = run_experiment(exp, session=session or _SESSION, fresh=True, progress=False)
    except Exception as e:  # noqa: BLE001 -- a failed run is a row saying so, not the end of the table
        return None, time.perf_counter() - t0, None, f"{type(e).__name__}: {e}"
    name = f"{summary['attack']} {summary['norm']} {summary['eps']:.4g}"
    return summary["asr"] or 0.0, time.perf_counter() - t0, name, None


def key(exp):
    return f"{exp['attack']}:{exp['threat']['norm']}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--devices", default="cpu,cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--max-diff", type=float, default=3.0, help="points of ASR allowed between devices")
    ap.add_argument("--first", default="", help="comma-separated attacks to run before the others (those that a "
                    "time limit must not cut, e.g. the decision attacks of the issue, and the longest runs)")
    ap.add_argument("--cpu-workers", type=int, default=12, help="processes for the CPU runs (0: the main "
                    "process); with --cpu-threads, the cores the CPU runs may use at once. The default leaves 4 of 16 "
                    "cores to the CUDA workers")
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch threads of a CPU run (a ResNet-20 run on 32 "
                    "images gains little from more: square_linf 3.2 s on 1 thread, 2.7 s on 16)")
    ap.add_argument("--wide", default="", help="comma-separated attacks (or attack:norm) whose CPU runs get "
                    "--wide-threads threads: the forward-heavy ones that dominate the section")
    ap.add_argument("--wide-threads", type=int, default=3)
    ap.add_argument("--cuda-workers", type=int, default=4, help="processes for the CUDA runs (0: the main "
                    "process), one torch thread each; the runs are launch-bound, so a few share the GPU well")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="bbb_asr_"))
    devices = args.devices.split(",")
    print(f"| config | run | {' | '.join(f'{d} ASR' for d in devices)} | diff (points) | "
          f"{' | '.join(f'{d} s' for d in devices)} | ok |", flush=True)
    print("|---" * (3 + 2 * len(devices)) + "|---|", flush=True)
    first = [a for a in args.first.split(",") if a]
    runs = [(cfg, exp) for cfg in args.configs
            for exp in load_config(cfg, [f"dataset.n={args.n}", f"output_dir={out}"])[0]]
    runs.sort(key=lambda run: first.index(run[1]["attack"]) if run[1]["attack"] in first else len(first))

    wide = {w for w in args.wide.split(",") if w}
    cores = max(args.cpu_workers, 1) * args.cpu_threads

    def threads(exp):
        return min(cores, args.wide_threads if exp["attack"] in wide or key(exp) in wide else args.cpu_threads)

    spawn = multiprocessing.get_context("spawn")
    pools, local = {}, []
    for d in dict.fromkeys(devices):
        workers = args.cpu_workers if d == "cpu" else args.cuda_workers
        if workers > 0:
            pools[d] = cf.ProcessPoolExecutor(workers, mp_context=spawn, initializer=_start_worker)
    done = {}  # (run index, device) -> run_one's result
    futures = {}  # future -> (run index, device)
    lock, queued, free = threading.Lock(), collections.deque(), [cores]

    def hand_out():
        """Submit queued CPU runs, in order, while their threads fit in the free cores (also called from the
        pool's thread when a CPU run ends)."""
        with lock:
            while queued and threads(runs[queued[0]][1]) <= free[0]:
                i = queued.popleft()
                t = threads(runs[i][1])
                try:
                    f = pools["cpu"].submit(run_one, dict(runs[i][1], device="cpu"), None, t)
                except Exception as e:  # noqa: BLE001 -- a pool broken by a worker that died
                    done[i, "cpu"] = (None, 0.0, None, f"worker: {type(e).__name__}: {e}")
                    continue
                free[0] -= t
                futures[f] = (i, "cpu")
                f.add_done_callback(lambda _, t=t: (release(t), hand_out()))

    def release(t):
        with lock:
            free[0] += t

    for i, (_, exp) in enumerate(runs):
        for d in devices:
            if d == "cpu" and d in pools:
                queued.append(i)
            elif d in pools:  # one torch thread: the work is on the GPU, the cores are the CPU runs'
                with lock:
                    futures[pools[d].submit(run_one, dict(exp, device=d), None, 1)] = (i, d)
            else:
                local.append((i, d))
    hand_out()
    t_start, bad, printed = time.perf_counter(), 0, set()

    def emit():
        nonlocal bad
        for i, (cfg, _) in enumerate(runs):
            if i in printed or any((i, d) not in done for d in devices):
                continue
            printed.add(i)
            res = [done[i, d] for d in devices]
            name = next((r[2] for r in res if r[2]), runs[i][1]["attack"])
            errors = [f"{d}: {r[3]}" for d, r in zip(devices, res) if r[3]]
            asr = [r[0] for r in res if r[0] is not None]
            diff = 100 * (max(asr) - min(asr)) if asr and not errors else float("nan")
            ok = not errors and diff <= args.max_diff
            bad += not ok
            print(f"| {Path(cfg).name} | {name} | {' | '.join('-' if r[0] is None else f'{r[0]:.3f}' for r in res)}"
                  f" | {diff:.1f} | {' | '.join(f'{r[1]:.1f}' for r in res)} | "
                  f"{'yes' if ok else 'NO'}{' (' + '; '.join(errors) + ')' if errors else ''} |", flush=True)

    def collect(block):
        with lock:
            pending = list(futures)
        if not pending:  # a CPU run just ended and the next is being handed out
            time.sleep(0.05)
        finished = cf.wait(pending, timeout=None if block else 0, return_when=cf.FIRST_COMPLETED).done
        for f in finished:
            with lock:
                where = futures.pop(f)
            try:
                done[where] = f.result()
            except Exception as e:  # noqa: BLE001 -- a worker that died
                done[where] = (None, 0.0, None, f"worker: {type(e).__name__}: {e}")
        emit()

    sessions = {d: Session() for _, d in local}
    for i, d in local:
        done[i, d] = run_one(dict(runs[i][1], device=d), sessions[d])
        collect(block=False)
    while futures or queued:
        collect(block=True)
    emit()
    for p in pools.values():
        p.shutdown()
    workers = ", ".join(f"{d}: {args.cpu_workers} ({cores} threads in all; {args.wide_threads} each for "
                        f"{args.wide or 'none'})" if d == "cpu" else f"{d}: {args.cuda_workers}" for d in pools) \
        or "none"
    print(f"{bad} run(s) differ by more than {args.max_diff} points (or failed); {len(runs)} runs in "
          f"{time.perf_counter() - t_start:.0f} s; worker processes {workers}; {os.cpu_count()} cores", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
