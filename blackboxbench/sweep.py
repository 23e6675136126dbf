"""Sweeps: a config's ``grid`` expands its runs into every combination of the listed values, and a backend runs
the resulting experiments one after another in this process (``serial``, the default), in worker processes of
this machine (``processes``) or as tasks of a Ray cluster (``ray``: across machines).

Each experiment is a whole run with its own results folder (named by its config hash), so the backends differ only
in where the runs execute: a run writes its records as samples finish and resumes after a crash as it does alone,
and two workers never run the same experiment (the runner holds a lock on its folder). For ``processes`` and
``ray`` the results folder must be one every worker sees (a local disk for ``processes``; a shared file system
across machines for ``ray``); the data root and the model cache likewise. The leaderboard and the plots are made
after every run has finished, by the process that launched the sweep.

A worker builds its own models (nothing is shared across processes) and runs with ``threads`` CPU threads; Ray
reserves ``cpus`` and ``gpus`` per run so that a GPU is never shared by two runs.
"""
import copy
import itertools
import os

from .config import ConfigError, parse_number, set_dotted
from .errors import one_line_warning

BACKENDS = ("serial", "processes", "ray")


def expand_grid(runs, grid, source):
    """``runs`` (a list of run mappings) times every combination of ``grid`` (dotted key -> list of values, in the
    order given: the last key varies fastest). A value written as arithmetic (``8/255``) stays a string for the
    config's own parsing. A grid key a run also sets is a config error: the grid would silently override it."""
    if not grid:
        return runs
    for key, values in grid.items():
        if not isinstance(key, str) or not all(key.split(".")):
            raise ConfigError("grid keys are dotted config keys such as threat.eps", source, f"grid.{key}")
        if not isinstance(values, list) or not values:
            raise ConfigError("must be a non-empty list of values", source, f"grid.{key}")
    out = []
    for i, run in enumerate(runs):
        for key in grid:
            node = run
            for p in key.split("."):
                node = node.get(p) if isinstance(node, dict) else None
            if node is not None:
                raise ConfigError(f"the grid sets {key}, which runs[{i}] sets too", source, f"grid.{key}")
        for combo in itertools.product(*grid.values()):
            r = copy.deepcopy(run)
            for key, value in zip(grid, combo):
                set_dotted(r, key, copy.deepcopy(value), source, f"grid.{key}")
            out.append(r)
    return out


def check_backend(spec, source):
    """The ``backend`` file key: a name or ``{name, workers, threads, cpus, gpus, address}``, checked and filled."""
    spec = {"name": spec} if isinstance(spec, str) else dict(spec or {"name": "serial"})
    allowed = {"name", "workers", "threads", "cpus", "gpus", "address"}
    for k in spec:
        if k not in allowed:
            raise ConfigError(f"unknown key; allowed: {', '.join(sorted(allowed))}", source, f"backend.{k}")
    if spec.get("name") not in BACKENDS:
        raise ConfigError(f"unknown backend {spec.get('name')!r}; one of {', '.join(BACKENDS)}", source,
                          "backend.name")
    if spec["name"] == "serial" and (given := [k for k in ("workers", "cpus", "gpus", "address") if k in spec]):
        raise ConfigError(f"the serial backend runs in this process: {given[0]} is for the processes and ray "
                          "backends (name: processes)", source, f"backend.{given[0]}")
    out = {"name": spec["name"], "workers": spec.get("workers", 2), "threads": spec.get("threads", 1),
           "cpus": spec.get("cpus", 1), "gpus": spec.get("gpus", 0), "address": spec.get("address")}
    for k in ("workers", "threads", "cpus"):
        if not isinstance(out[k], int) or isinstance(out[k], bool) or out[k] < 1:
            raise ConfigError("must be an integer >= 1", source, f"backend.{k}")
    gpus = parse_number(out["gpus"]) if isinstance(out["gpus"], str) else out["gpus"]
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 0:
        raise ConfigError("must be a number >= 0 (a fraction shares a GPU)", source, "backend.gpus")
    if out["address"] is not None and not isinstance(out["address"], str):
        raise ConfigError("must be a Ray address such as auto or ray://head:10001", source, "backend.address")
    out["gpus"] = gpus
    return out


def run_one(exp, fresh, threads):
    """Run one validated experiment in this process; returns ``(run folder, summary)``. What a worker executes."""
    import torch

    from .runner import Runner, Session

    if threads:
        torch.set_num_threads(threads)
    runner = Runner(exp, fresh=fresh, progress=False)
    runner.session = Session()
    return runner.run_dir, runner.run()


def run_sweep(experiments, backend, fresh=False, done=lambda run_dir: None):
    """Run ``experiments`` on ``backend`` (see :func:`check_backend`); returns their summaries in order.
    ``done(run folder)`` is called as each finishes. Every run goes to the end even if another fails; the first
    error is raised then."""
    name = backend["name"]
    if name == "processes":
        return _processes(experiments, backend, fresh, done)
    if name == "ray":
        return _ray(experiments, backend, fresh, done)
    return collect(len(experiments), ((i, attempt(run_one, exp, fresh, None)) for i, exp in enumerate(experiments)),
                    done)


def attempt(fn, *args):
    """``fn(*args)``, or the exception it raised (runs in this process go on after a failure)."""
    try:
        return fn(*args)
    except Exception as e:
        return e


def _worker_init(parent):
    """A ``processes`` worker: warnings one line, as in the launching process; and it exits when that process is
    gone (killed: nothing else would stop the workers, which would run on and hold their run folders' locks; a
    run cut short resumes like any interrupted run)."""
    import threading
    import time
    import warnings

    warnings.formatwarning = one_line_warning

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _ray_task(exp, fresh, threads):
    """A Ray task: :func:`run_one`, its warnings one line."""
    import warnings

    warnings.formatwarning = one_line_warning
    return run_one(exp, fresh, threads)


def collect(n, finished, done):
    """Gather ``(index, (what done() is given, summary) or error)`` pairs into summaries in order; raise the first
    error once all are in."""
    summaries, errors = [None] * n, []
    for i, result in finished:
        if isinstance(result, BaseException):
            errors.append(result)
            continue
        done(result[0])
        summaries[i] = result[1]
    if errors:
        raise errors[0]
    return summaries


def _processes(experiments, backend, fresh, done):
    import concurrent.futures as cf
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
    with cf.ProcessPoolExecutor(max_workers=backend["workers"], mp_context=ctx, initializer=_worker_init,
                                initargs=(os.getpid(),)) as pool:
        futures = {pool.submit(run_one, e, fresh, backend["threads"]): i for i, e in enumerate(experiments)}

        def finished():
            for f in cf.as_completed(futures):
                yield futures[f], f.exception() or f.result()

        return collect(len(experiments), finished(), done)


def _ray(experiments, backend, fresh, done):
    try:
        import ray
    except ImportError:
        raise ConfigError("backend ray needs the ray package: pip install ray (or, in a checkout of this "
                          "repository, pip install '.[ray]')", experiments[0].get("_source") if experiments else None,
                          "backend.name") from None
    if not ray.is_initialized():
        address = backend["address"] or os.environ.get("RAY_ADDRESS")
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                 **({} if address else {"num_cpus": backend["workers"] * backend["cpus"]}))
    task = ray.remote(num_cpus=backend["cpus"], num_gpus=backend["gpus"], max_retries=0)(_ray_task)
    refs = {task.remote(e, fresh, backend["threads"]): i for i, e in enumerate(experiments)}

    def finished():
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                yield refs[ready[0]], ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the worker's own exception, as raised there
                yield refs[ready[0]], e.as_instanceof_cause()

    return collect(len(experiments), finished(), done)
