"""Sweeps: a config's ``grid`` expands its runs into every combination of the listed values, and a backend runs
the resulting experiments one after another in this process (``serial``, the default), in worker processes of
this machine (``processes``) or as tasks of a Ray cluster (``ray``: across machines).

Each experiment is a whole run with its own results folder (named by its config hash), so the backends differ only
in where the runs execute: a run writes its records as samples finish and resumes after a crash as it does alone,
and two workers never run the same experiment (the runner holds a lock on its folder). For ``processes`` and
``ray`` the results folder must be one every worker sees (a local disk for ``processes``; a shared file system
across machines for ``ray``); the data root and the model cache likewise. A Ray task runs in the launcher's working
directory (a config's relative paths mean the same there) with the launcher's ``PATH_VARS``, and is run again when
its worker or node dies (the run resumes). The leaderboard and the plots are made after every run has finished, by
the process that launched the sweep.

A worker builds its own models (nothing is shared across processes) and runs with ``threads`` CPU threads; Ray
reserves ``cpus`` and ``gpus`` per run so that a GPU is never shared by two runs.
"""
import copy
import itertools
import os
import socket
import traceback
import warnings

from .config import ConfigError, parse_number, set_dotted
from .errors import BenchError, one_line_warning

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


# the environment variables a run takes paths from (data root, model cache, torch hub): a Ray worker has its node's
PATH_VARS = ("BLACKBOXBENCH_DATA", "BLACKBOXBENCH_CACHE", "TORCH_HOME")


def launcher_place():
    """Where the launcher runs, for a worker to take on (:func:`take_place`): its working directory (a config's
    relative paths are relative to it) and the path variables it has set, made absolute."""
    return {"cwd": os.getcwd(), "env": {k: os.path.abspath(os.path.expanduser(os.environ[k])) for k in PATH_VARS
                                        if os.environ.get(k)}}


def for_worker(exp):
    """``exp`` with its ``output_dir`` absolute, as the launcher sees it (not part of the run hash: the run folder
    stays the serial run's), so no worker writes its results under its own working directory."""
    return {**exp, "output_dir": os.path.abspath(os.path.expanduser(exp["output_dir"]))}


def take_place(place, exp):
    """In a worker: the launcher's path variables and working directory; a relative path of ``exp`` that cannot
    be resolved (no such directory on this machine) is a one-line error naming it."""
    os.environ.update(place["env"])
    if os.path.isdir(place["cwd"]):
        os.chdir(place["cwd"])
        return
    for key in ("data_root", "lpips_path"):
        if exp.get(key) and not os.path.isabs(os.path.expanduser(exp[key])):
            raise ConfigError(f"{exp[key]} is relative to the launcher's working directory {place['cwd']}, which "
                              f"the worker on {socket.gethostname()} does not have: give an absolute path",
                              exp.get("_source"), key)


def run_one(exp, fresh, threads, place=None):
    """Run one validated experiment in this process; returns ``(run folder, summary)``. What a worker executes
    (``place``: the launcher's, :func:`launcher_place`)."""
    import torch

    from .runner import Runner, Session

    if place:
        take_place(place, exp)
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
    """``fn(*args)``, or the exception it raised (runs in this process go on after a failure). The exception keeps
    its traceback (file, line and function of each frame) but not the frames' local variables: those hold the
    failed run's models, session, worker and tensors, which would otherwise stay alive (on its device) until the
    sweep ends, one set per failed run."""
    try:
        return fn(*args)
    except Exception as e:
        seen, err = set(), e
        while err is not None and id(err) not in seen:  # the chained exceptions' frames too
            seen.add(id(err))
            traceback.clear_frames(err.__traceback__)
            err = err.__cause__ or err.__context__
        return e


def _worker_init(parent):
    """A ``processes`` worker: warnings one line, as in the launching process; and it exits when that process is
    gone (killed: nothing else would stop the workers, which would run on and hold their run folders' locks; a
    run cut short resumes like any interrupted run)."""
    import threading
    import time

    warnings.formatwarning = one_line_warning

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _ray_task(exp, fresh, threads, place):
    """A Ray task: :func:`run_one` where the launcher is, its warnings one line."""
    warnings.formatwarning = one_line_warning
    return run_one(exp, fresh, threads, place)


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


RETRIES = 3  # Ray runs a task again this many times when its worker or node dies


def _first_line(err):
    return (str(err).strip().splitlines() or [""])[0][:300]


def _resources(r):
    return f"{r.get('CPU', 0):g} CPU, {r.get('GPU', 0):g} GPU"


def _reachable(address, where):
    """A ``host:port`` address must answer at once: Ray itself waits minutes for a head that is not there."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host:
        return  # ray.init's own error
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise ConfigError(f"no Ray cluster at {address}{'' if where[0] else ' (RAY_ADDRESS)'}: "
                          f"{e.strerror or type(e).__name__}", *where) from None


def _ray(experiments, backend, fresh, done):
    try:
        import ray
    except ImportError:
        raise ConfigError("backend ray needs the ray package: pip install ray (or, in a checkout of this "
                          "repository, pip install '.[ray]')", experiments[0].get("_source") if experiments else None,
                          "backend.name") from None
    if not ray.is_initialized():
        address = backend["address"] or os.environ.get("RAY_ADDRESS")
        where = (experiments[0].get("_source") if experiments else None, "backend.address") if backend["address"] \
            else (None, None)
        _reachable(address, where)
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                     **({} if address else {"num_cpus": backend["workers"] * backend["cpus"]}))
        except (ConnectionError, ValueError, TimeoutError) as e:
            raise ConfigError(f"no Ray cluster at {address}{'' if where[0] else ' (RAY_ADDRESS)'}: "
                              f"{_first_line(e)}", *where) from None
    need = {"CPU": backend["cpus"], "GPU": backend["gpus"]}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):  # Ray would wait for one silently
        warnings.warn(f"no node of the Ray cluster has {need['CPU']} CPU and {need['GPU']} GPU for a run "
                      f"(backend cpus, gpus; nodes: {'; '.join(_resources(r) for r in nodes) or 'none'}): the runs "
                      "wait until such a node joins")
    # a task whose worker or node died is run again (RETRIES times; it resumes from its records under its lock);
    # a run's own error is not
    task = ray.remote(num_cpus=backend["cpus"], num_gpus=backend["gpus"], max_retries=RETRIES)(_ray_task)
    place = launcher_place()
    refs = {task.remote(for_worker(e), fresh, backend["threads"], place): i for i, e in enumerate(experiments)}

    def finished():
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = refs[ready[0]]
            try:
                run_dir, summary = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the worker's own exception, as raised there
                yield i, e.cause if isinstance(e.cause, BaseException) else e.as_instanceof_cause()
            except ray.exceptions.RayError as e:  # lost: its worker or node died RETRIES + 1 times
                yield i, BenchError(f"run {i + 1} of the sweep was lost {RETRIES + 1} times ({type(e).__name__}: "
                                    f"{_first_line(e)}); run the sweep again to resume it")
            else:
                if not os.path.isdir(run_dir):  # written where the launcher cannot see it
                    yield i, BenchError(f"run folder {run_dir} was written by a Ray worker but is not on this "
                                        "machine: output_dir must be a file system every node shares")
                else:
                    yield i, (run_dir, summary)

    return collect(len(experiments), finished(), done)
