"""A CLI run in a subprocess that stops once its records file holds a given number of lines and waits there (holding
its run folder's lock) until the test releases or kills it: a test that must act on a run still in progress (kill it
mid-run, start a second process on its folder) then does so on any machine, however fast or loaded. Timing cannot
decide it, as it did when such tests polled a free-running process: on a fast machine the run could end (or write its
last record) before the kill landed; under load, the test could act after the run had ended.

The hold is a patch of ``RecordWriter.write`` in the subprocess only (nothing in the config, the model or the fused
inference copy changes): after the write that brings ``records.jsonl`` to ``at`` complete lines or more (flushed), it
says so (a marker file) and sleeps until the release file exists. A kill then leaves what a kill anywhere between that
write and the next leaves on disk, and always the same records."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

HOLD = """
import os, runpy, sys, time
from pathlib import Path
import blackboxbench.runner as runner

at, held, release, parent = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
script = sys.argv[5]
sys.argv = [script, *sys.argv[6:]]
write = runner.RecordWriter.write


def write_then_hold(self, records):
    write(self, records)
    if not release.exists() and (self.run_dir / "records.jsonl").read_bytes().count(b"\\n") >= at:
        held.touch()
        while not release.exists():
            if os.getppid() != parent:  # the test's process is gone: do not hold for ever
                os._exit(1)
            time.sleep(0.01)


runner.RecordWriter.write = write_then_hold
runpy.run_path(script, run_name="__main__")
"""


class HeldRun:
    """``scripts/run.py CONFIG --quiet`` in a subprocess that holds once its run has written ``at`` records (use it as a
    context manager: a run still held when the block ends is killed). It runs on this process's CPU threads (the
    suite's: one), as the in-process runs a test compares it with, not on torch's default of one per core."""

    def __init__(self, config, out, at):
        self.out, self.at = Path(out), at
        self.held_file = Path(config).parent / f".held_{Path(config).stem}"
        self.release_file = Path(config).parent / f".release_{Path(config).stem}"
        self.stderr = Path(config).parent / f"stderr_{Path(config).stem}.txt"
        env = dict(os.environ, PYTHONPATH=str(REPO))
        with open(self.stderr, "w") as err:
            hold = [str(at), str(self.held_file), str(self.release_file), str(os.getpid())]
            self.proc = subprocess.Popen([sys.executable, "-c", HOLD, *hold, str(REPO / "scripts" / "run.py"),
                                          str(config), "--quiet", "--threads", str(torch.get_num_threads())],
                                         env=env, stdout=subprocess.DEVNULL, stderr=err)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:  # a test that failed before it released or killed the run
            self.kill()

    def records(self):
        """The run's ``records.jsonl`` (the one run folder under ``out``), or None before it exists."""
        files = list(self.out.glob("*/records.jsonl"))
        return files[0] if files else None

    def wait_held(self, limit_s=600):
        """Wait until the run holds (``at`` records written and flushed, the process in its wait) and return its
        records file; fails if the run ends first. ``limit_s`` only keeps a hung run from hanging the suite: the
        outcome does not depend on it."""
        end = time.monotonic() + limit_s
        while self.proc.poll() is None and time.monotonic() < end:
            if self.held_file.exists():
                return self.records()
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"the run ended (exit code {self.proc.returncode}) or took over {limit_s} s before "
                             f"writing {self.at} records: {self.stderr.read_text()[-2000:]}")

    def release(self, timeout=300):
        """Let the run go on; returns its exit code."""
        self.release_file.touch()
        return self.proc.wait(timeout=timeout)

    def kill(self):
        """SIGKILL the run (once held, it cannot have ended) and reap it."""
        self.proc.kill()
        self.proc.wait()
