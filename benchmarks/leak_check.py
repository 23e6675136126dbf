"""Memory and resources over long runs and sweeps (issue 7): counts after each run of a serial sweep in one
process, and inside one query run as thousands of samples flow through a fixed number of slots.

    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py within [attack ...]   # one long run per attack
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py within-cifar [attack ...]   # CIFAR-10, ResNet-20
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py sweep N       # N small runs, one Session (the CLI's)
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py share N       # the same with share_forwards
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py processes N   # run_sweep's serial backend
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py families N    # N transfer + N detection runs
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py resnet N      # ResNet-20 runs, a Session each
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py failing N     # N runs that fail mid-run
    BLACKBOXBENCH_DATA=... python benchmarks/leak_check.py prior N       # N PSBA runs (a trained prior)

LEAK_KEEP_FREED=1 applies ``blackboxbench run``'s allocator setting first (``malloc.py``). Prints, per checkpoint:
VmRSS (MB), live gc objects, live torch tensors, open fds, threads, and the types whose live count grew most since
the first checkpoint."""
import collections
import gc
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from blackboxbench import runner as runner_mod  # noqa: E402
from blackboxbench.config import load_config  # noqa: E402
from blackboxbench.runner import Session, run_all, Runner  # noqa: E402
from blackboxbench.sweep import run_sweep  # noqa: E402


def rss_mb():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tensors():
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def type_counts():
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def snapshot():
    gc.collect()
    return dict(rss=rss_mb(), objs=len(gc.get_objects()), tensors=tensors(), fds=len(os.listdir("/proc/self/fd")),
                threads=threading.active_count())


def show(label, s):
    print(f"{label:>24}  rss {s['rss']:7.1f} MB  objs {s['objs']:8d}  tensors {s['tensors']:6d}  fds {s['fds']:3d}"
          f"  threads {s['threads']:2d}", flush=True)


def grown(before, top=8):
    after = type_counts()
    diff = [(k, after[k] - before.get(k, 0)) for k in after]
    diff = sorted((d for d in diff if d[1] > 0), key=lambda d: -d[1])[:top]
    print("   grew:", ", ".join(f"{k} +{v}" for k, v in diff) or "nothing", flush=True)


def write_config(tmp, text):
    p = Path(tmp) / "c.yaml"
    p.write_text(text)
    return p


def within(attacks, n=1297, slots=32, queries=60, dataset="{name: digits, n: 1297, split: train}", model="digits_mlp",
           extra=""):
    """One run per attack over ``dataset`` (the digits train split: 1297 samples), ``slots`` slots: counts every
    n / 6 records, and the worker's per-sample structures (which must hold the samples in flight only)."""
    orig = runner_mod.schedule

    def watched(worker, pending, write, on_progress):
        seen = [0, 0]
        base = {}

        def progress(records):
            on_progress(records)
            seen[0] += len(records)
            if seen[0] - seen[1] >= max(n // 6, 1) or seen[0] == len(pending):
                seen[1] = seen[0]
                s = snapshot()
                show(f"{seen[0]} samples", s)
                s.update(started=len(worker.started), paths=len(worker.paths), unaudited=len(worker.unaudited),
                         ready=len(worker.ready))
                print("   worker:", {k: s[k] for k in ("started", "paths", "unaudited", "ready")}, flush=True)
                if not base:
                    base.update(type_counts())
                else:
                    grown(base)
        return orig(worker, pending, write, progress)

    runner_mod.schedule = watched
    for attack in attacks:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = write_config(tmp, f"""dataset: {dataset}
model: {model}
{extra}
seed: 0
device: cpu
batch_size: {slots}
output_dir: {tmp}/out
threat: {{norm: linf, eps: 0.2, max_queries: {queries}}}
runs: [{{attack: {attack}}}]
""")
            exps, _ = load_config(cfg)
            print(f"== {attack}: {n} samples, {slots} slots, {queries} queries", flush=True)
            run_all([Runner(e, progress=False) for e in exps], Session())
    runner_mod.schedule = orig


MODELS = ["digits_mlp", "digits_cnn", "digits_lenet"]
SWEEP = ["square_linf", "rays", "bandits_linf", "parsimonious", "signhunter", "hsja_linf", "nes", "simba_dct"]


def sweep(n_runs, share=False, processes=False):
    """``n_runs`` small query runs (attack, eps, seed and target model varied) in this process, as ``blackboxbench
    run`` runs a serial config: one Session, :func:`run_all` (``share``: share_forwards); ``processes``: through
    :func:`run_sweep`'s serial backend (a Session per run, as a worker does)."""
    import yaml
    with tempfile.TemporaryDirectory() as tmp:
        runs = [{"attack": SWEEP[i % len(SWEEP)], "seed": i, "threat": {"eps": 0.1 + 0.01 * (i % 5)},
                 "model": MODELS[i % len(MODELS)]} for i in range(n_runs)]
        cfg = write_config(tmp, yaml.safe_dump({
            "dataset": {"name": "digits", "n": 8}, "device": "cpu", "batch_size": 8,
            "output_dir": f"{tmp}/out", "threat": {"norm": "linf", "max_queries": 40}, "runs": runs}))
        exps, opts = load_config(cfg)
        marks = []
        base = {}

        def done(_):
            s = snapshot()
            marks.append(s["objs"])
            show(f"run {len(marks)}", s)
            if len(marks) == 1:
                base.update(type_counts())
            elif len(marks) % 10 == 0 or len(marks) == n_runs:
                grown(base)
        if processes:
            run_sweep(exps, opts["backend"], done=done)
        else:
            run_all([Runner(e, progress=False) for e in exps], Session(), share, done)


TRANSFER = ["mi_fgsm", "di2_fgsm", "fia", "ila", "ti_fgsm", "linbp", "vt", "sia"]


def hooks(session):
    """Forward hooks on the modules of the session's models (a run's feature taps must all be gone)."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for net in session.models.values()
               if isinstance(net, torch.nn.Module) for m in net.modules())


def resnet(n_runs):
    """``n_runs`` tiny query runs on CIFAR-10 ResNet-20 through :func:`run_sweep`'s serial backend (a Session per
    run, as a ``processes`` worker runs run after run): torch.fx's store of generated code (one inference copy per
    run; before the fix it kept 4 entries per run)."""
    import linecache

    import yaml
    from torch.fx import graph_module
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_config(tmp, yaml.safe_dump({
            "dataset": {"name": "cifar10", "n": 2}, "model": "cifar_resnet20", "device": "cpu", "batch_size": 2,
            "output_dir": f"{tmp}/out", "threat": {"norm": "linf", "eps": 0.03, "max_queries": 10},
            "runs": [{"attack": "square_linf", "seed": i} for i in range(n_runs)]}))
        exps, opts = load_config(cfg)
        count = [0]

        def done(_):
            count[0] += 1
            show(f"run {count[0]}", snapshot())
            print(f"   fx generated code kept {len(graph_module._loader.eval_cache)}, linecache {len(linecache.cache)}",
                  flush=True)
        run_sweep(exps, opts["backend"], done=done)


def failing(n_runs):
    """``n_runs`` query runs (64 digits, 64 slots) that each fail after a few steps, through :func:`run_sweep`'s
    serial backend: what a failed run leaves alive until the sweep ends (before the fix: its Session, models,
    worker and tensors, kept by the exception's frames)."""
    import yaml
    from blackboxbench import sweep as sweep_mod
    from blackboxbench.query import pipeline
    step, attempt = pipeline.QueryWorker.step, sweep_mod.attempt

    def failing_step(self):
        if self.oracle.forwarded > 20:
            raise RuntimeError("a step failed")
        return step(self)

    def counted(fn, *args):
        out = attempt(fn, *args)
        show("after a failed run", snapshot())
        print("   live nn.Modules", sum(1 for o in gc.get_objects() if isinstance(o, torch.nn.Module)),
              "QueryWorkers", sum(1 for o in gc.get_objects() if isinstance(o, pipeline.QueryWorker)), flush=True)
        return out

    pipeline.QueryWorker.step, sweep_mod.attempt = failing_step, counted
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = write_config(tmp, yaml.safe_dump({
                "dataset": {"name": "digits", "n": 64}, "model": "digits_mlp", "device": "cpu", "batch_size": 64,
                "output_dir": f"{tmp}/out", "threat": {"norm": "linf", "eps": 0.1, "max_queries": 100},
                "runs": [{"attack": "square_linf", "seed": i} for i in range(n_runs)]}))
            exps, opts = load_config(cfg)
            try:
                run_sweep(exps, opts["backend"])
            except RuntimeError as e:
                print("the sweep raised its first error:", e)
    finally:
        pipeline.QueryWorker.step, sweep_mod.attempt = step, attempt


def prior(n_runs):
    """``n_runs`` PSBA runs (its auto-encoder prior trained from the digits CNN on 200 digits train images, a
    small prior: 3 epochs; cached on disk after the first run), 40 digits through 8 slots each, one Session: live
    modules and the per-run networks ``prep.trained`` keeps (before the fix: the last 8 runs', after their end)."""
    import yaml
    from blackboxbench.prep import trained
    with tempfile.TemporaryDirectory() as tmp:
        cfg = write_config(tmp, yaml.safe_dump({
            "dataset": {"name": "digits", "n": 40}, "model": "digits_mlp", "surrogates": ["digits_cnn"],
            "device": "cpu", "batch_size": 8, "output_dir": f"{tmp}/out",
            "assets": {"train": {"name": "train_images", "spec": {"name": "digits", "split": "train", "n": 200}}},
            "threat": {"norm": "l2", "eps": 1.5, "max_queries": 100},
            "runs": [{"attack": {"recipe": "psba", "blocks": {"perturb": {"name": "psba", "epochs": 3, "views": 1}}},
                      "seed": i} for i in range(n_runs)]}))
        exps, _ = load_config(cfg)
        count = [0]

        def done(_):
            count[0] += 1
            show(f"run {count[0]}", snapshot())
            print(f"   live nn.Modules {sum(1 for o in gc.get_objects() if isinstance(o, torch.nn.Module))}, "
                  f"entries in prep.trained._RUN {len(trained._RUN)}", flush=True)
        run_all([Runner(e, progress=False) for e in exps], Session(), False, done)


def families(n_runs):
    """``n_runs`` transfer runs (attacks varied: feature taps, surgery, input transforms), then ``n_runs``
    detection runs (the detection quickstart's first run, seed varied), each set with one Session as ``blackboxbench
    run`` does; the counts after each run, and the hooks left on the session's models."""
    import yaml
    repo = Path(__file__).resolve().parent.parent
    for name in ("transfer", "detection"):
        with tempfile.TemporaryDirectory() as tmp:
            if name == "transfer":
                cfg = write_config(tmp, yaml.safe_dump({
                    "dataset": {"name": "digits", "n": 16}, "device": "cpu", "batch_size": 16,
                    "output_dir": f"{tmp}/out", "threat": {"norm": "linf", "eps": 0.2},
                    "surrogates": ["digits_cnn"], "targets": ["digits_mlp", "digits_lenet"],
                    "runs": [{"attack": TRANSFER[i % len(TRANSFER)], "seed": i} for i in range(n_runs)]}))
                exps, _ = load_config(cfg)
            else:
                exps, _ = load_config(repo / "configs" / "detection_quickstart.yaml", [f"output_dir={tmp}/out"])
                exps = [{**exps[0], "seed": i} for i in range(n_runs)]
            session, count, base = Session(), [0], {}

            def done(_):
                count[0] += 1
                s = snapshot()
                show(f"{name} run {count[0]}", s)
                print(f"   models in session {len(session.models)}, hooks on them {hooks(session)}", flush=True)
                if count[0] == 1:
                    base.update(type_counts())
                elif count[0] == n_runs:
                    grown(base)
            run_all([Runner(e, progress=False) for e in exps], session, False, done)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if os.environ.get("LEAK_KEEP_FREED"):  # as `blackboxbench run` does (malloc.py): the heap is never trimmed
        from blackboxbench.malloc import keep_freed_memory
        print("keep_freed_memory:", keep_freed_memory())
    what = sys.argv[1] if len(sys.argv) > 1 else "sweep"
    if what == "within":
        within(sys.argv[2:] or ["square_linf", "hsja_linf", "bandits_linf", "parsimonious", "signhunter"])
    elif what == "within-cifar":  # CIFAR-10 (300 images), ResNet-20, 20 slots, each sample's path kept
        within(sys.argv[2:] or ["square_linf"], n=300, slots=20, queries=40, dataset="{name: cifar10, n: 300}",
               model="cifar_resnet20", extra="save_path_every: 5")
    elif what == "prior":
        prior(int(sys.argv[2]) if len(sys.argv) > 2 else 6)
    elif what == "failing":
        failing(int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    elif what == "resnet":
        resnet(int(sys.argv[2]) if len(sys.argv) > 2 else 6)
    elif what in ("sweep", "share", "processes"):
        sweep(int(sys.argv[2]) if len(sys.argv) > 2 else 40, what == "share", what == "processes")
    else:
        families(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
