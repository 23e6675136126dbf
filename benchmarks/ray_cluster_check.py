"""Checks the ray sweep backend (blackboxbench/sweep.py) on a local two-node Ray cluster: a head and a second
node, each a raylet of its own with 1 CPU, started with ``ray start`` from working directories of their own and
without the launcher's BLACKBOXBENCH_* variables (as on other machines). Prints a row per check and exits 1 on a
mismatch. Needs the ray package (not part of the test suite).

    BLACKBOXBENCH_DATA=/path/to/data python benchmarks/ray_cluster_check.py

1. records: a 2 attacks x 2 eps sweep (CIFAR-10 ResNet-20 with a data root, else the digits MLP) on the cluster,
   its output_dir relative to the launcher's directory, gives the records of ``backend: serial``, and its runs
   ran on both nodes.
2. kills: (a) a worker process killed with SIGKILL mid-run, (b) the launcher interrupted (SIGINT) mid-sweep and
   launched again, (c) the second node's raylet killed with SIGKILL mid-sweep: each sweep ends with every run
   complete, no sample recorded twice, the serial records.

Records are compared as the set of lines per run folder, without the wall time and the checksum (which covers
the time).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
CONFIG = """dataset: {dataset}
model: {model}
device: cpu
seed: 0
batch_size: 1
output_dir: {out}
runs:
  - {{attack: square_linf, threat: {{norm: linf}}}}
  - {{attack: simba_dct, threat: {{norm: linf}}}}
grid: {{threat.eps: [{eps}], threat.max_queries: [{queries}]}}
backend: {backend}
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    return {k: v for k, v in os.environ.items() if not k.startswith(("BLACKBOXBENCH_", "RAY_"))}


def cpu_pin(i):
    """``taskset -c i`` where the machine has a CPU i (each node on its own core), else nothing."""
    return ["taskset", "-c", str(i)] if shutil.which("taskset") and i < (os.cpu_count() or 1) else []


def start_node(args, cwd):
    cwd.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(args, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")


def raylet_pid(node_id):
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if f"--node_id={node_id}".encode() in cmd.read_bytes() and b"raylet" in cmd.read_bytes():
                return int(cmd.parent.name)
        except OSError:
            continue
    return None


def stop_cluster(temp_dir, port):
    """End this cluster's processes (those naming its temp dir or its port, and their children), by pid: another
    Ray cluster of the machine lives on."""
    marks = (temp_dir.encode(), f":{port} ".encode(), f":{port}\0".encode())
    procs = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            procs[int(stat.parent.name)] = (int(stat.read_text().rsplit(")", 1)[1].split()[1]), _cmd(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    mine = {pid for pid, (_, cmd) in procs.items() if any(m in cmd for m in marks) and pid != os.getpid()}
    for _ in range(3):
        mine |= {pid for pid, (parent, _) in procs.items() if parent in mine}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in mine:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        time.sleep(2.0)


def records(root):
    """{run folder name: sorted record lines without time and check}; raises on a sample recorded twice."""
    out = {}
    for f in sorted(Path(root).glob("*/records.jsonl")):
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        idx = [r["index"] for r in rows]
        if len(idx) != len(set(idx)):
            raise AssertionError(f"{f}: a sample recorded twice")
        out[f.parent.name] = sorted(json.dumps({k: v for k, v in r.items() if k not in ("time", "check")},
                                               sort_keys=True) for r in rows)
    return out


def where_task(exp, fresh, threads, place):
    """The sweep's Ray task, first noting its node and pid (pickled by value: runs on the workers)."""
    import ray as _ray

    from blackboxbench import sweep

    with open(place["where"], "a") as f:
        f.write(f"{_ray.get_runtime_context().get_node_id()} {os.getpid()} {exp['output_dir']} {exp['threat']}\n")
    return sweep._ray_task(exp, fresh, threads, {k: v for k, v in place.items() if k != "where"})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="keep the work folder and the cluster's files")
    args = ap.parse_args()
    import warnings

    import ray

    from blackboxbench.errors import one_line_warning

    warnings.formatwarning = one_line_warning

    from blackboxbench import sweep
    from blackboxbench.config import load_config

    data = os.environ.get("BLACKBOXBENCH_DATA")
    cifar = bool(data) and Path(data, "cifar10/cifar10_test_first100.npz").is_file()
    dataset, model = ("{name: cifar10, n: 4}", "cifar_resnet20") if cifar else ("{name: digits, n: 4}", "digits_mlp")
    eps = "4/255, 8/255" if cifar else "0.1, 0.2"
    work = Path(tempfile.mkdtemp(prefix="ray_cluster_check_"))
    launch = work / "launch"
    launch.mkdir()
    os.chdir(launch)
    port = free_port()
    print(f"ray {ray.__version__}; {model} on {dataset}; work folder {work}", flush=True)
    address = f"127.0.0.1:{port}"
    rows, bad = [], []

    def row(name, ok, detail):
        rows.append(name)
        bad.extend([name] if not ok else [])
        print(f"{'ok ' if ok else 'BAD'}  {name:<44} {detail}", flush=True)

    def config(name, backend, queries):
        path = launch / f"{name}.yaml"
        path.write_text(CONFIG.format(dataset=dataset, model=model, out=name, eps=eps, queries=queries,
                                      backend=backend))
        return path

    where = work / "where.txt"
    real_place = sweep.launcher_place
    sweep.launcher_place = lambda: {**real_place(), "where": str(where)}
    sweep._ray_task = where_task
    ray_backend = f"{{name: ray, address: '{address}', cpus: 1, threads: 1}}"
    try:
        start_node(cpu_pin(0) + [RAY, "start", "--head", "--num-cpus", "1", "--port", str(port), "--temp-dir",
                                 str(work / "ray"), "--include-dashboard", "false", "--disable-usage-stats"],
                   work / "head")
        ray.init(address=address, logging_level="ERROR")
        head = ray.nodes()[0]["NodeID"]
        ray.shutdown()
        start_node(cpu_pin(1) + [RAY, "start", "--address", f"127.0.0.1:{port}", "--num-cpus", "1",
                                 "--disable-usage-stats"], work / "node2")
        # 1. records and placement
        exps, opts = load_config(config("serial", "serial", 300))
        sweep.run_sweep(exps, opts["backend"])
        want = records("serial")
        exps, opts = load_config(config("ray", ray_backend, 300))
        sweep.run_sweep(exps, opts["backend"])
        got = records("ray")
        row("records equal serial (relative output_dir)", got == want and len(got) == 4,
            f"{len(got)} runs, {sum(map(len, got.values()))} records (serial {sum(map(len, want.values()))})")
        nodes = [line.split()[0] for line in where.read_text().splitlines()]
        row("runs on both nodes", len(set(nodes)) == 2,
            ", ".join(f"node {n[:8]}: {nodes.count(n)} runs" for n in sorted(set(nodes))))
        second = next(n for n in nodes if n != head)
        ray.shutdown()

        # 2. kills, on longer runs
        q = 3000
        exps, opts = load_config(config("serial_long", "serial", q))
        t0 = time.time()
        sweep.run_sweep(exps, opts["backend"])
        want = records("serial_long")
        print(f"     (serial long sweep: {time.time() - t0:.1f} s)", flush=True)

        def wait_records(folder, n=1, timeout=300):
            deadline = time.time() + timeout
            while time.time() < deadline:
                if sum(len(f.read_text().splitlines()) for f in Path(folder).glob("*/records.jsonl")) >= n:
                    return True
                time.sleep(0.2)
            return False

        def background(name):
            log = open(work / f"{name}.log", "a")
            cfg = config(name, ray_backend, q)
            return subprocess.Popen([sys.executable, "-c", KILL_LAUNCHER, str(cfg), str(where)], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=launch, env=os.environ), work / f"{name}.log"

        def finish(name, proc, log):
            rc = proc.wait(timeout=600)
            got = records(name)
            n = sum(map(len, got.values()))
            return rc, got, n, log.read_text()

        # (a) a worker process killed
        where.write_text("")
        proc, log = background("kill_worker")
        wait_records("kill_worker", 1)
        victim = where.read_text().split()[1]
        os.kill(int(victim), signal.SIGKILL)
        rc, got, n, text = finish("kill_worker", proc, log)
        row("worker process killed (SIGKILL)", rc == 0 and got == want,
            f"rc {rc}, {len(got)} runs, {n} records, equal to serial: {got == want}; "
            f"{len(where.read_text().splitlines())} task starts for 4 runs")

        # (b) the launcher interrupted and launched again
        where.write_text("")
        proc, log = background("kill_launcher")
        wait_records("kill_launcher", 2)
        proc.send_signal(signal.SIGINT)
        rc1 = proc.wait(timeout=120)
        before = sum(map(len, records("kill_launcher").values()))
        proc, log = background("kill_launcher")
        rc, got, n, text = finish("kill_launcher", proc, log)
        row("launcher interrupted (SIGINT), run again", rc == 0 and got == want,
            f"first rc {rc1} with {before} records; again rc {rc}, {n} records, equal to serial: {got == want}")

        # (c) the second node's raylet killed
        where.write_text("")
        proc, log = background("kill_node")
        wait_records("kill_node", 1)
        starts = [line.split() for line in where.read_text().splitlines() if line]
        # the second node, while it runs a task
        busy = [s[0] for s in starts if Path(f"/proc/{s[1]}").exists() and s[0] != head]
        gone = busy[-1] if busy else second
        os.kill(raylet_pid(gone), signal.SIGKILL)
        rc, got, n, text = finish("kill_node", proc, log)
        row("second node's raylet killed (SIGKILL)", rc == 0 and got == want,
            f"rc {rc}, {len(got)} runs, {n} records, equal to serial: {got == want}; "
            f"{len(where.read_text().splitlines())} task starts for 4 runs")
    finally:
        ray.shutdown()
        stop_cluster(str(work / "ray"), port)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(rows) - len(bad)} of {len(rows)} checks held" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def _cmd(pid):
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# the launcher of a kill check, in a process of its own: the CLI with the task noting where it runs
KILL_LAUNCHER = """
import sys
sys.path.insert(0, {here!r})
import ray
import ray_cluster_check as rcc
from blackboxbench import sweep
ray.cloudpickle.register_pickle_by_value(rcc)
from blackboxbench.cli import main
real = sweep.launcher_place
sweep.launcher_place = lambda: {{**real(), "where": sys.argv[2]}}
sweep._ray_task = rcc.where_task
sys.exit(main(["run", sys.argv[1], "--quiet"]))
""".format(here=str(Path(__file__).resolve().parent))

if __name__ == "__main__":
    sys.exit(main())
