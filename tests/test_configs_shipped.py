"""Every shipped config validates (names, keys, parameters) without running."""
from pathlib import Path

import pytest

from blackboxbench.config import load_config
from blackboxbench.runner import prepare

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_validates(path):
    experiments, _ = load_config(path)
    for exp in experiments:
        prepare(exp)
