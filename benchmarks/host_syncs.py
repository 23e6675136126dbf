"""Host syncs per step of every run of a config, at two slot counts: a call that needs a tensor's value on the host
(``item``, ``tolist``, ``bool`` / ``int`` / ``float`` of a tensor, ``nonzero``, ``unique``, ``cpu``, ``numpy``,
boolean-mask indexing: on a GPU each one waits for the device) counted while a query worker steps or a transfer
attack iterates, per step (query) or per iteration (transfer). A site whose count per step grows with the slots
syncs per sample; on the CPU such a site costs little, on a GPU it stalls every iteration. Prints, per run, the
counts at both slot counts and the sites whose count per step grows (``--slots A B``: runs of A and of B samples in
as many slots).

    PYTHONPATH=. BLACKBOXBENCH_DATA=../shared/data python benchmarks/host_syncs.py CONFIG --slots 8 32 --threads 1

The counts are of calls made on the CPU; the same calls sync on a GPU. Finishing samples add a few per finish
(their records' metrics), so a run where more finish events fall into the steps counts somewhat more per step.
"""
import argparse
import collections
import functools
import json
import subprocess
import sys
import tempfile

import torch

SYNCING = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")


def _instrument(counts, sites, active):
    def caller():
        f = sys._getframe(2)
        while f is not None and "blackboxbench" not in f.f_code.co_filename:
            f = f.f_back
        return "?" if f is None else f"{f.f_code.co_filename.split('blackboxbench/')[-1]}:{f.f_lineno}"

    def wrap(owner, name, when=None):
        orig = getattr(owner, name)

        @functools.wraps(orig)
        def counted(*args, **kwargs):
            if active[0] and (when is None or when(*args)):
                counts[name] += 1
                sites[caller()] += 1
            return orig(*args, **kwargs)
        setattr(owner, name, counted)

    def bool_index(_, index):
        flags = index if isinstance(index, tuple) else (index,)
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flags)

    for name in SYNCING:
        wrap(torch.Tensor, name)
    wrap(torch.Tensor, "__getitem__", bool_index)
    wrap(torch, "nonzero")
    wrap(torch, "unique")


def child(config, slots, threads, out):
    """One run of ``config`` at ``slots`` samples and slots, counting; a JSON line per run to ``out``."""
    from blackboxbench import runner
    from blackboxbench.cli import main
    from blackboxbench.query.pipeline import QueryWorker
    from blackboxbench.transfer.pipeline import TransferAttack

    counts, sites, active, steps = collections.Counter(), collections.Counter(), [False], [0]
    _instrument(counts, sites, active)

    def counting(fn, per_call):
        def inner(self, *args, **kwargs):
            active[0] = True
            steps[0] += per_call(self)
            try:
                return fn(self, *args, **kwargs)
            finally:
                active[0] = False
        return inner

    QueryWorker.step = counting(QueryWorker.step, lambda self: 1)
    TransferAttack._loop = counting(TransferAttack._loop, lambda self: self.iterations)
    run = runner.Runner.run

    def reporting(self, *args, **kwargs):
        counts.clear(), sites.clear()
        steps[0] = 0
        try:
            return run(self, *args, **kwargs)
        finally:
            k = max(1, steps[0])
            with open(out, "a") as f:
                f.write(json.dumps({"run": self.attack.name, "steps": steps[0], "per_step": sum(counts.values()) / k,
                                    "sites": {s: v / k for s, v in sites.items()}}) + "\n")

    runner.Runner.run = reporting
    with tempfile.TemporaryDirectory() as tmp:
        main(["run", config, "--quiet", "--fresh", "--threads", str(threads), "--set", f"batch_size={slots}",
              "--set", f"dataset.n={slots}", "--set", f"output_dir={tmp}"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--slots", type=int, nargs=2, default=(8, 32))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.config, args.child, args.threads, args.out)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for s in args.slots:
            out = f"{tmp}/{s}.jsonl"
            subprocess.run([sys.executable, __file__, args.config, "--child", str(s), "--out", out, "--threads",
                            str(args.threads)], check=True, stdout=subprocess.DEVNULL)
            found[s] = [json.loads(line) for line in open(out)]
    a, b = args.slots
    for ra, rb in zip(found[a], found[b]):
        print(f"{ra['run']:20s} syncs per step {ra['per_step']:7.2f} ({a} slots) {rb['per_step']:7.2f} ({b} slots)")
        for site in sorted(set(ra["sites"]) | set(rb["sites"])):
            va, vb = ra["sites"].get(site, 0.0), rb["sites"].get(site, 0.0)
            if vb > 1.3 * va + 0.5:
                print(f"    grows: {site:40s} {va:7.2f} -> {vb:7.2f}")


if __name__ == "__main__":
    main()
