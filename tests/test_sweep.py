"""Sweeps (blackboxbench/sweep.py): the ``grid`` expansion of a config's runs, the ``backend`` key, and the three
backends giving the same records as running alone (``processes`` and ``ray`` in other processes; ``ray`` only
where the ray package is installed, as the ``ray`` extra)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blackboxbench.config import load_config
from blackboxbench.errors import BenchError, ConfigError
from blackboxbench.sweep import check_backend, expand_grid, for_worker, launcher_place, run_one, run_sweep

NO_RAY = "the ray package is not installed (pip install ray, or '.[ray]')"

BASE = """
dataset: {name: digits, n: 6}
surrogates: [digits_cnn]
targets: [digits_mlp]
threat: {norm: linf, eps: 0.2}
device: cpu
batch_size: 4
output_dir: OUT
"""


def write(tmp_path, extra):
    path = tmp_path / "cfg.yaml"
    path.write_text(BASE.replace("OUT", str(tmp_path / "results")) + extra)
    return path


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "records.jsonl").read_text().splitlines()]


def strip(rec):
    """A record without its wall time and its checksum (which covers the time)."""
    return {k: v for k, v in rec.items() if k not in ("time", "check")}


def test_grid_is_every_combination_times_the_runs():
    runs = expand_grid([{"attack": "a"}, {"attack": "b"}], {"threat.eps": [1, 2], "seed": [0, 1, 2]}, "c.yaml")
    assert len(runs) == 12
    assert runs[0] == {"attack": "a", "threat": {"eps": 1}, "seed": 0}
    assert runs[1] == {"attack": "a", "threat": {"eps": 1}, "seed": 1}  # the last key varies fastest
    assert runs[6]["attack"] == "b" and expand_grid([{"x": 1}], None, "c") == [{"x": 1}]



def test_grid_values_go_into_copies_of_the_run():
    """Each combination sets its values in its own copy of the run: a run's mapping that a grid key reaches into
    (``threat`` with its norm, ``grid: {threat.eps: ...}``) is not shared between the expanded runs, nor changed."""
    run = {"attack": "a", "threat": {"norm": "l2"}}
    runs = expand_grid([run], {"threat.eps": [1, 2]}, "c.yaml")
    assert runs == [{"attack": "a", "threat": {"norm": "l2", "eps": 1}}, {"attack": "a", "threat": {"norm": "l2", "eps": 2}}]
    assert run == {"attack": "a", "threat": {"norm": "l2"}}

@pytest.mark.parametrize("grid,runs,message", [
    ({"threat.eps": 0.1}, [{}], "grid.threat.eps: must be a non-empty list"),
    ({"threat.eps": []}, [{}], "grid.threat.eps: must be a non-empty list"),
    ({"threat..eps": [1]}, [{}], "grid keys are dotted config keys"),
    ({"threat.eps": [1]}, [{}, {"threat": {"eps": 2}}], "the grid sets threat.eps, which runs[1] sets too"),
    ({"attack.hyper.iterations": [1]}, [{"attack": "lgv"}], "grid.attack.hyper.iterations: cannot set inside a "
                                                             "non-mapping"),
])
def test_grid_errors_are_one_line(grid, runs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[").replace("]", r"\]")) as e:
        expand_grid(runs, grid, "c.yaml")
    assert "\n" not in str(e.value) and str(e.value).startswith("c.yaml:")


def test_config_grid_expands_into_validated_experiments(tmp_path):
    exps, opts = load_config(write(tmp_path, "runs: [{attack: i_fgsm}, {attack: mi_fgsm}]\n"
                                             "grid: {threat.eps: [0.1, 8/255], seed: [0, 1]}\n"))
    assert len(exps) == 8 and opts["backend"]["name"] == "serial"
    assert [e["threat"]["eps"] for e in exps[:4]] == [0.1, 0.1, "8/255", "8/255"]  # parsed with the recipe
    with pytest.raises(ConfigError, match="grid.threat.epss|threat.epss"):
        load_config(write(tmp_path, "grid: {threat.epss: [0.1]}\nattack: i_fgsm\n"))


@pytest.mark.parametrize("spec,message", [
    ("slurm", "unknown backend 'slurm'"), ({"name": "ray", "nodes": 2}, "backend.nodes: unknown key"),
    ({"name": "processes", "workers": 0}, "backend.workers: must be an integer >= 1"),
    ({"name": "ray", "gpus": -1}, "backend.gpus: must be a number >= 0"),
    ({"name": "ray", "address": 3}, "backend.address: must be a Ray address")])
def test_backend_errors_are_one_line(spec, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_backend(spec, "c.yaml")
    assert "\n" not in str(e.value)
    assert check_backend({"name": "ray", "gpus": "1/2"}, "c")["gpus"] == 0.5


def test_share_forwards_needs_the_serial_backend(tmp_path):
    with pytest.raises(ConfigError, match="share_forwards needs the runs in one process"):
        load_config(write(tmp_path, "attack: i_fgsm\nshare_forwards: true\nbackend: processes\n"))


def sweep_config(folder, backend):
    folder.mkdir()
    return write(folder, f"backend: {backend}\nattack: {{recipe: i_fgsm, hyper: {{iterations: 5}}}}\n"
                         "grid: {threat.eps: [0.1, 0.2]}\n")


def serial_records(tmp_path):
    exps, _ = load_config(sweep_config(tmp_path / "serial", "serial"))
    dirs = []
    run_sweep(exps, check_backend("serial", "c"), done=dirs.append)
    return [[strip(r) for r in records(d)] for d in dirs]


def test_processes_backend_gives_the_serial_records(tmp_path):
    want = serial_records(tmp_path)
    exps, opts = load_config(sweep_config(tmp_path / "p", "{name: processes, workers: 2}"))
    dirs = []
    summaries = run_sweep(exps, opts["backend"], done=dirs.append)
    got = {d: [strip(r) for r in records(d)] for d in dirs}
    assert len(summaries) == 2 and all(s["n"] == 6 for s in summaries)
    assert sorted(map(json.dumps, got.values())) == sorted(map(json.dumps, want))


def test_cli_runs_a_grid_on_worker_processes_and_a_failing_run_lets_the_others_finish(tmp_path):
    cfg = write(tmp_path, "attack: {recipe: i_fgsm, hyper: {iterations: 3}}\n"
                          f"data_root: {tmp_path}\n"
                          "grid: {dataset: [{name: digits, n: 6}, {name: cifar10, file: no/such.npz}]}\n")
    out = subprocess.run([sys.executable, "-m", "blackboxbench.cli", "run", str(cfg), "--quiet", "--backend",
                          "processes", "--workers", "2"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "2 runs on backend processes" in out.stderr
    error = out.stderr.strip().splitlines()[-1]
    assert "such.npz" in error and "Traceback" not in out.stderr
    done = [line.split()[1] for line in out.stderr.splitlines() if line.startswith("run ")]
    assert len(done) == 1 and len(records(done[0])) == 6  # the digits run finished


def test_ray_backend_gives_the_serial_records(tmp_path):
    ray = pytest.importorskip("ray", reason=NO_RAY)
    want = serial_records(tmp_path)
    exps, opts = load_config(sweep_config(tmp_path / "r", "{name: ray, workers: 2}"))
    dirs = []
    try:
        run_sweep(exps, opts["backend"], done=dirs.append)
        exps[0]["dataset"] = {"name": "cifar10", "file": "no/such.npz"}
        exps[0]["data_root"] = str(tmp_path)
        with pytest.raises(BenchError, match="such.npz") as e:  # the worker's own one-line error
            run_sweep(exps, opts["backend"])
        assert str(e.value).startswith(f"{exps[0]['_source']}:dataset: ") and "\n" not in str(e.value)
        assert "ray::" not in str(e.value) and "File " not in str(e.value)  # not Ray's traceback of it
    finally:
        ray.shutdown()
    got = [[strip(r) for r in records(d)] for d in dirs]
    assert sorted(map(json.dumps, got)) == sorted(map(json.dumps, want))


def test_a_worker_elsewhere_runs_where_the_launcher_is(tmp_path, monkeypatch):
    """A Ray worker runs in its node's directory with its node's environment: given the launcher's place, a run
    with a relative output_dir and data_root writes the serial run's folder and records, and takes the launcher's
    path variables; a launcher directory the worker lacks is a one-line error naming the relative path."""
    launch = tmp_path / "launch"
    (launch / "data").mkdir(parents=True)
    path = launch / "c.yaml"
    path.write_text(BASE.replace("OUT", "results") + "data_root: data\nattack: {recipe: i_fgsm, hyper: {iterations: 2}}\n")
    monkeypatch.chdir(launch)
    exps, _ = load_config(path)
    dirs = []
    run_sweep(exps, check_backend("serial", "c"), done=dirs.append)
    want = [strip(r) for r in records(dirs[0])]
    place, exp = launcher_place(), for_worker(exps[0])  # in the launcher
    monkeypatch.setenv("BLACKBOXBENCH_CACHE", str(tmp_path / "node_cache"))  # the node's own
    (tmp_path / "node").mkdir()
    monkeypatch.chdir(tmp_path / "node")
    run_dir, summary = run_one(exp, True, 1, place)
    assert Path(run_dir) == launch / dirs[0] and summary["n"] == 6
    assert [strip(r) for r in records(run_dir)] == want and not (tmp_path / "node" / "results").exists()
    assert os.environ["BLACKBOXBENCH_CACHE"] == place["env"]["BLACKBOXBENCH_CACHE"]
    with pytest.raises(ConfigError) as e:
        run_one(exp, False, 1, {"cwd": str(tmp_path / "gone"), "env": {}})
    assert str(e.value).startswith(f"{path}:data_root: data is relative to the launcher's working directory "
                                   f"{tmp_path / 'gone'}, which the worker on ") and "\n" not in str(e.value)


def test_ray_address_errors_are_one_line(tmp_path, monkeypatch):
    """No cluster at the address: one line naming it, at once (Ray itself waits minutes for a missing head)."""
    pytest.importorskip("ray", reason=NO_RAY)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    path = sweep_config(tmp_path / "r", "{name: ray, address: nonsense}")
    exps, opts = load_config(path)
    with pytest.raises(ConfigError, match=f"^{path}:backend.address: no Ray cluster at nonsense: "):
        run_sweep(exps, opts["backend"])
    with pytest.raises(ConfigError, match=f"^{path}:backend.address: no Ray cluster at 127.0.0.1:{port}: "):
        run_sweep(exps, {**opts["backend"], "address": f"127.0.0.1:{port}"})
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=f"^no Ray cluster at 127.0.0.1:{port} \\(RAY_ADDRESS\\): "):
        run_sweep(exps, {**opts["backend"], "address": None})


def test_ray_reservations_are_passed_as_written_and_one_no_node_fits_warns(tmp_path, monkeypatch):
    """Each task reserves the backend's cpus and gpus (a fraction too) and is run again if its worker dies; a
    reservation no node of the cluster can hold is a warning (Ray would wait for such a node in silence)."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    asked = []

    def remote(**kwargs):
        asked.append(kwargs)
        raise KeyboardInterrupt  # stop before submitting

    exps, opts = load_config(sweep_config(tmp_path / "r", "{name: ray, workers: 2, cpus: 1, gpus: 1/2}"))
    try:
        monkeypatch.setattr(ray, "remote", remote)
        with pytest.warns(UserWarning, match=r"no node of the Ray cluster has 1 CPU and 0.5 GPU for a run .*"
                                             r"nodes: 2 CPU, 0 GPU\)"), pytest.raises(KeyboardInterrupt):
            run_sweep(exps, opts["backend"])
    finally:
        ray.shutdown()
    assert asked == [{"num_cpus": 1, "num_gpus": 0.5, "max_retries": 3}]


def test_ray_run_whose_worker_is_killed_is_run_again_and_resumes(tmp_path):
    """A Ray worker killed mid-run (kill -9: as when its node goes down): Ray runs the task again, the run
    resumes from its records under its lock, and the sweep ends with every run complete, no sample twice."""
    ray = pytest.importorskip("ray", reason=NO_RAY)
    import signal
    import threading
    import time

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 8}}\nmodel: digits_mlp\nattack: square_linf\ndevice: cpu\n"
                   f"batch_size: 2\nthreat: {{norm: linf, eps: 0.03, max_queries: 4000}}\n"
                   f"output_dir: {tmp_path / 'res'}\ngrid: {{seed: [0, 1]}}\nbackend: {{name: ray, workers: 2}}\n")
    exps, opts = load_config(cfg)
    killed = []

    def kill_first_worker():
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            for rec in (tmp_path / "res").glob("*/records.jsonl"):
                if rec.read_text().count("\n") >= 1:  # mid-run: one batch written, three to go
                    pid = int((rec.parent / ".lock").read_text().split()[1])
                    os.kill(pid, signal.SIGKILL)
                    killed.append(rec.parent)
                    return
            time.sleep(0.1)

    watcher = threading.Thread(target=kill_first_worker, daemon=True)
    watcher.start()
    dirs = []
    try:
        summaries = run_sweep(exps, opts["backend"], done=dirs.append)
    finally:
        ray.shutdown()
    watcher.join()
    assert killed and len(killed[0].joinpath("records.jsonl").read_text().splitlines()) == 8
    assert len(summaries) == 2 and all(s["n"] == 8 for s in summaries)
    for d in dirs:
        assert sorted(r["index"] for r in records(d)) == list(range(8))


def test_ray_backend_without_ray_names_the_file(tmp_path, monkeypatch):
    """Without the ray package the ray backend is a one-line error naming the config file and the key, with the
    install line for both an installed package and a checkout."""
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, installed or not
    path = sweep_config(tmp_path / "r", "{name: ray, workers: 2}")
    exps, opts = load_config(path)
    with pytest.raises(ConfigError) as e:
        run_sweep(exps, opts["backend"])
    assert str(e.value).startswith(f"{path}:backend.name: backend ray needs the ray package: pip install ray")
    assert "'.[ray]'" in str(e.value)


def test_workers_of_a_serial_backend(tmp_path, capsys, monkeypatch):
    """A worker count given to the serial backend is not silently dropped: in the config it is a one-line error;
    --workers on the command line runs the config's runs in worker processes, and says so."""
    path = sweep_config(tmp_path / "s", "{name: serial, workers: 4}")
    with pytest.raises(ConfigError, match="backend.workers: the serial backend runs in this process"):
        load_config(path)
    import blackboxbench.sweep as sweep
    from blackboxbench.cli import main

    calls = []
    real = sweep._processes
    monkeypatch.setattr(sweep, "_processes", lambda exps, backend, fresh, done: calls.append(backend) or
                        real(exps, backend, fresh, done))
    path = sweep_config(tmp_path / "p", "serial")
    assert main(["run", str(path), "--quiet", "--workers", "2", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert calls and calls[0]["name"] == "processes" and calls[0]["workers"] == 2 and calls[0]["threads"] == 1
    assert "--workers 2: the config's backend is serial; running on backend processes" in err
    assert main(["run", str(path), "--quiet", "--backend", "serial", "--workers", "2"]) == 2
    assert "backend.workers: the serial backend" in capsys.readouterr().err


def _children(pid):
    """The pids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")
def test_processes_workers_print_one_line_warnings_and_die_with_their_launcher(tmp_path):
    """Worker processes print library warnings on one line, as the launcher does; killed, the launcher takes its
    workers with it (they would otherwise run on, holding their run folders' locks)."""
    import signal
    import time

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 100}}\nmodel: digits_mlp\nattack: square_linf\ndevice: cpu\n"
                   f"threat: {{norm: linf, eps: 0.004, max_queries: 100000}}\noutput_dir: {tmp_path / 'res'}\n"
                   "grid: {seed: [0, 1]}\nbackend: {name: processes, workers: 2, threads: 1}\n")
    env = {**os.environ, "TORCH_HOME": str(tmp_path / "torch")}  # no AlexNet trunk: the LPIPS warning
    log = open(tmp_path / "err.txt", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "blackboxbench.cli", "run", str(cfg), "--quiet"], env=env,
                                stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((tmp_path / "res").glob("*/records.jsonl"))) < 2:
        time.sleep(0.5)
    workers = [p for p in _children(launcher.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) == 2, workers
    time.sleep(1.0)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() for p in workers):
        time.sleep(0.5)
    alive = [p for p in workers if Path(f"/proc/{p}").exists()]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    assert not alive, "workers outlived their launcher"
    log.close()
    err = (tmp_path / "err.txt").read_text()
    lpips = [line for line in err.splitlines() if "LPIPS" in line or "ALEXNET_FILE" in line]
    assert len(lpips) == 2 and all(line.startswith("warning: LPIPS column left empty") for line in lpips), err
