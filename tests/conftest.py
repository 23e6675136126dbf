"""Shared fixtures. Tests needing the real offline assets skip when the data root is absent."""
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true",
                     help="also run the long fidelity checks (marked slow: each trains a model for minutes)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long fidelity check (it trains a model for minutes on one core); "
                            "skipped unless --slow, so that the README's test command stays inside CI's 20 minutes")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="long fidelity check: run with --slow (benchmarks/RESULTS.md gives its figures)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def find_data_root():
    env = os.environ.get("BLACKBOXBENCH_DATA")
    root = Path(env) if env else REPO.parent / "shared" / "data"
    return root if root.is_dir() else None


@pytest.fixture(scope="session")
def data_root():
    root = find_data_root()
    if root is None:
        pytest.skip("offline data root absent (set BLACKBOXBENCH_DATA or provide ../shared/data)")
    return root


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Models trained on first use (digits_*) go to a per-session cache unless the caller set one."""
    if "BLACKBOXBENCH_CACHE" not in os.environ:
        os.environ["BLACKBOXBENCH_CACHE"] = str(tmp_path_factory.mktemp("bbb_cache"))
    # One thread: small-batch forwards are 5-10x slower with two threads on a shared 2-core machine, and the
    # results do not depend on it. BLACKBOXBENCH_TEST_THREADS overrides.
    torch.set_num_threads(int(os.environ.get("BLACKBOXBENCH_TEST_THREADS", "1")))
    # `blackboxbench run` sets glibc's allocator for its whole process; the tests that call it must not change the
    # worker's allocator for the tests after them (tests/test_malloc.py checks the real one in child processes)
    import blackboxbench.malloc as bmalloc
    real, bmalloc.keep_freed_memory = bmalloc.keep_freed_memory, lambda: False
    yield
    bmalloc.keep_freed_memory = real


@pytest.fixture
def fresh_registries():
    """Registrations a test's plugins make are undone afterwards, and their modules forgotten (a plugin metric
    would otherwise be computed in every later run of this worker)."""
    from blackboxbench.registry import restore, snapshot
    before, modules = snapshot(), set(sys.modules)
    yield
    restore(before)
    for name in set(sys.modules) - modules:
        if name.startswith("bbb_plugin_"):
            del sys.modules[name]
