"""Memory and resources over long runs and sweeps (issue 7): nothing a run creates outlives it in the process that
ran it (models, workers, tensors, hooks, open files, threads, generated code), and a query worker keeps per-sample
state for the samples in its slots only. Counts, not RSS or time (``benchmarks/leak_check.py`` measures those)."""
import gc
import linecache
import os
import threading

import pytest
import torch
import yaml
from torch import nn

from blackboxbench import runner as runner_mod
from blackboxbench.config import load_config
from blackboxbench.prep.inference import inference_copy
from blackboxbench.query import pipeline
from blackboxbench.runner import Runner, Session, run_all
from blackboxbench.sweep import run_sweep


def _config(tmp_path, runs, **top):
    cfg = {"dataset": {"name": "digits", "n": 8}, "model": "digits_mlp", "device": "cpu", "batch_size": 8,
           "output_dir": str(tmp_path / "out"), "threat": {"norm": "linf", "eps": 0.2, "max_queries": 30},
           "runs": runs, **top}
    cfg = {k: v for k, v in cfg.items() if v is not None}  # None: drop the default's key
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def _live(kind):
    return sum(1 for o in gc.get_objects() if isinstance(o, kind))


def _counts():
    gc.collect()
    return {"tensors": _live(torch.Tensor), "modules": _live(nn.Module), "workers": _live(pipeline.QueryWorker),
            "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count()}


def _bn_net():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1),
                         nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10)).eval()


def _fx_sources():
    from torch.fx import graph_module
    return len(graph_module._loader.eval_cache), sum(1 for k in linecache.cache if k.startswith("<eval_with_key>"))


def test_inference_copies_leave_no_generated_code_behind():
    """torch.fx keeps the code of every module it generates (its loader's store and linecache) for the life of the
    process; each inference copy (one per run and target in a sweep's Session per run) added 4 entries that never
    went. They now go with the copy, and stay while it lives (tracebacks through it still show its code)."""
    probe = torch.rand(4, 1, 8, 8)
    before = _fx_sources()
    copies = [inference_copy(_bn_net(), probe, "bn") for _ in range(5)]
    assert all(isinstance(c, torch.fx.GraphModule) for c in copies)  # folded copies, not the models as built
    alive = _fx_sources()
    assert alive[0] > before[0]  # the copies were traced (BatchNorm folded): their code is there while they live
    del copies
    gc.collect()
    assert _fx_sources() == before


def test_failed_runs_of_a_serial_sweep_release_their_models_and_tensors(tmp_path, monkeypatch):
    """A run that fails lets the sweep go on; its exception was kept (to be raised at the end) with its frames'
    locals: the failed run's Session, models, worker and slot tensors stayed alive, one set per failed run."""
    exps, opts = _config(tmp_path, [{"attack": "square_linf", "seed": i} for i in range(3)])
    step = pipeline.QueryWorker.step

    def failing(self):
        if self.oracle.forwarded > 8:
            raise RuntimeError("step failed")
        return step(self)

    monkeypatch.setattr(pipeline.QueryWorker, "step", failing)
    after = []
    import blackboxbench.sweep as sweep
    real = sweep.attempt

    def counted(fn, *args):
        out = real(fn, *args)
        assert isinstance(out, RuntimeError)
        after.append(_counts())
        return out

    monkeypatch.setattr(sweep, "attempt", counted)
    with pytest.raises(RuntimeError, match="step failed") as e:
        run_sweep(exps, opts["backend"])
    assert "in failing" in "".join(__import__("traceback").format_tb(e.value.__traceback__))  # still says where
    assert after[0]["workers"] == after[-1]["workers"] == 0
    assert after[-1] == after[0], after


def _sweep_counts(tmp_path, runs, share=False):
    """Counts after each run of ``runs`` in one Session (``blackboxbench run``'s serial path)."""
    exps, _ = _config(tmp_path, runs)
    session, after = Session(), []
    run_all([Runner(e, progress=False) for e in exps], session, share, lambda r: after.append(_counts()))
    return session, after


def test_query_runs_in_one_session_keep_models_tensors_fds_and_threads_flat(tmp_path):
    """Runs of a serial config (one Session): models are built once per distinct model (the Session's cache), and
    nothing else accumulates: live tensors and modules, open files (records, locks) and threads after the last run
    are those after the first round of attacks."""
    attacks = ["square_linf", "rays", "bandits_linf", "signhunter"]
    runs = [{"attack": attacks[i % 4], "seed": i, "threat": {"eps": 0.1 + 0.02 * i}} for i in range(8)]
    session, after = _sweep_counts(tmp_path, runs)
    assert len(after) == 8
    assert len(session.models) == 2  # digits_mlp and its inference copy: one of each, whatever the run count
    assert after[-1] == after[3], (after[3], after[-1])
    assert after[-1]["fds"] == after[0]["fds"] and after[-1]["threads"] == after[0]["threads"]


def test_shared_forward_groups_release_their_greenlets(tmp_path):
    """share_forwards: each group's greenlets end with the group; no greenlet, worker or file outlives its runs."""
    greenlet = pytest.importorskip("greenlet").greenlet
    runs = [{"attack": a, "seed": i} for i, a in enumerate(["square_linf", "rays", "square_linf", "rays"])]
    _, after = _sweep_counts(tmp_path, runs, share=True)
    gc.collect()
    assert _live(greenlet) <= 1  # the main greenlet, if any
    assert _live(pipeline.QueryWorker) == 0
    assert after[-1]["fds"] == after[0]["fds"] and after[-1]["threads"] == after[0]["threads"]


def test_query_worker_keeps_per_sample_state_for_the_samples_in_flight_only(tmp_path, monkeypatch):
    """Many samples through few slots (each sample's path kept): the worker's per-sample dicts hold at most the
    samples in its slots and those waiting for the audit, and are empty at the end; live tensors do not grow with
    the samples done."""
    exps, _ = _config(tmp_path, [{"attack": "square_linf"}], dataset={"name": "digits", "n": 96, "split": "train"},
                      batch_size=6, save_path_every=4)
    seen = []
    real = runner_mod.schedule

    def watched(worker, pending, write, on_progress):
        def progress(records):
            on_progress(records)
            if records:
                gc.collect(1)  # the young generations: a finished step's cycles (a full collection is slow here)
                snapshots = sum(len(p) for p in worker.paths.values())  # the kept paths of samples in flight
                seen.append((len(worker.started), len(worker.paths), _live(torch.Tensor) - snapshots))
        real(worker, pending, write, progress)
        seen.append((len(worker.started), len(worker.paths), None))

    monkeypatch.setattr(runner_mod, "schedule", watched)
    Runner(exps[0], progress=False).run()
    assert len((tmp_path / "out").glob("*/records.jsonl").__next__().read_text().splitlines()) == 96
    assert max(s for s, _, _ in seen) <= 6 and max(p for _, p, _ in seen) <= 6
    assert seen[-1][:2] == (0, 0)
    tensors = [t for _, _, t in seen if t is not None]
    assert len(tensors) > 10
    # the working set varies by a few tensors from step to step; one tensor kept per finished sample would add 48
    assert max(tensors[len(tensors) // 2:]) <= max(tensors[:len(tensors) // 2]) + 16


def test_transfer_runs_in_one_session_leave_no_hooks_and_no_new_models(tmp_path):
    """Transfer runs with feature taps (FIA, ILA) and input transforms on the Session's cached surrogate: every
    hook is removed at the run's end, and the Session holds one model per distinct spec."""
    runs = [{"attack": a, "seed": i} for i, a in enumerate(["fia", "ila", "mi_fgsm", "fia", "ila"])]
    exps, _ = _config(tmp_path, runs, surrogates=["digits_cnn"], targets=["digits_mlp"], model=None,
                      threat={"norm": "linf", "eps": 0.2})
    session, after = Session(), []
    run_all([Runner(e, progress=False) for e in exps], session, False, lambda r: after.append(_counts()))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for net in session.models.values()
                if isinstance(net, nn.Module) for m in net.modules())
    assert hooks == 0
    models = len(session.models)
    assert after[-1]["modules"] == after[2]["modules"] and after[-1]["fds"] == after[0]["fds"]
    assert after[-1]["threads"] == after[0]["threads"]
    assert models <= 3  # digits_cnn, digits_mlp and the target's inference copy


def test_per_run_trained_networks_go_with_their_run():
    """``once_per_run`` (a run's AE decoders, c-Glow, AdvFlow's flow, NP-attack's ANP) kept the last 8 keys, each
    holding its run's asset and network, although a finished run's key (its asset's id) can never be asked for
    again: a sweep kept the networks of up to 8 finished runs alive. The entry now goes with the run's asset."""
    from blackboxbench.prep import trained
    from blackboxbench.prep.data import Dataset

    surrogate = nn.Linear(2, 2)
    before = dict(trained._RUN)
    for run in range(3):
        asset = Dataset("a", torch.zeros(2, 1, 2, 2), torch.zeros(2, dtype=torch.long), 10)
        key = ("block", id(asset), id(surrogate))
        net = trained.once_per_run(key, (asset, (surrogate,)), lambda: nn.Linear(2, 2))
        assert trained.once_per_run(key, (asset, (surrogate,)), lambda: None) is net  # once while the run lasts
        assert key in trained._RUN
        del asset
        gc.collect()
        assert key not in trained._RUN
    assert trained._RUN == before


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """``save_atomic`` writes through a randomly named temporary file: a write that failed (a full disk) left it in
    the cache folder, one more at every try."""
    from blackboxbench.errors import BenchError
    from blackboxbench.prep import models

    def full(obj, f):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(models.torch, "save", full)
    for _ in range(3):
        with pytest.raises(BenchError, match="No space left"):
            models.save_atomic({"w": torch.zeros(2)}, tmp_path / "net.pt")
    assert list(tmp_path.iterdir()) == []
