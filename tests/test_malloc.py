"""``blackboxbench.malloc.keep_freed_memory`` (glibc keeps freed memory; fewer page faults) and the ``run --malloc``
switch. The allocator setting is process-wide, so its effect is measured in child processes."""
import subprocess
import sys

import pytest

import blackboxbench.malloc as bmalloc
from blackboxbench.cli import main

CHILD = """
import resource, sys, torch
from blackboxbench.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def rounds(k):  # a 64 MiB activation allocated, written and freed, as in every step of an attack
    for _ in range(k):
        t = torch.empty(16 * 2 ** 20).fill_(1.0)
        del t
rounds(20)  # warm-up: with the setting, the heap settles within the first few rounds (up to 9 seen)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _child(mode):
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(not bmalloc.is_glibc(), reason="glibc only")
def test_keep_freed_memory_stops_the_page_faults_of_repeated_large_allocations():
    applied, kept = _child("keep")
    _, default = _child("default")
    assert applied == "True"
    # default glibc maps and unmaps the 64 MiB block every time: ~16 K faults per round; kept: none after warm-up
    assert default > 8 * 16 * 2 ** 20 // 4096
    assert kept < default / 10


def test_run_applies_it_unless_told_not_to(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(bmalloc, "keep_freed_memory", lambda: calls.append(1) or True)
    missing = str(tmp_path / "nope.yaml")
    assert main(["run", missing, "--quiet", "--malloc", "default"]) == 2  # the config error comes after the switch
    assert calls == []
    assert main(["run", missing, "--quiet"]) == 2
    assert calls == [1]
