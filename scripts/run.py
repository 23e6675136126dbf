#!/usr/bin/env python
"""Run one experiment config: ``python scripts/run.py CONFIG [--set key=value ...]``."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from blackboxbench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
