"""Leaderboard: every run under a results directory -> one CSV row per run.

Columns: the common ones, then each family's declared columns (with their direction, see
:mod:`blackboxbench.family`), then run metadata. Rows are sorted by ASR (higher first), then AQN (lower first);
a missing or non-finite value sorts last.
"""
import csv
import json
import math
from pathlib import Path

from .errors import BenchError
from .family import COMMON_COLUMNS, TRAILING_COLUMNS
from .registry import FAMILY


def columns():
    """[(column, direction)] of the CSV: common columns, every family's declared columns, run metadata."""
    out = {c: None for c in COMMON_COLUMNS}
    for name in FAMILY.names():
        for col, direction in FAMILY.get(name).columns:
            out.setdefault(col, direction)
    out.update({c: None for c in TRAILING_COLUMNS if c not in out})
    return list(out.items())


def collect(results_dirs):
    """Summaries of every finished run (a ``summary.json``) below the results directory (or directories)."""
    roots = [Path(results_dirs)] if isinstance(results_dirs, (str, Path)) else [Path(d) for d in results_dirs]
    rows = []
    for root in roots:
        if not root.is_dir():
            raise BenchError(f"results directory not found: {root}")
    for path in sorted(p for root in roots for p in root.rglob("summary.json")):
        try:
            rows.append(json.loads(path.read_text()))
        except json.JSONDecodeError:
            raise BenchError(f"corrupt summary: {path}") from None
    return rows


def _num(v, worst):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else worst


def sort_key(row):
    """Higher ASR first, then fewer queries (runs without queries last among equals)."""
    return (-_num(row.get("asr"), -math.inf), _num(row.get("aqn"), math.inf), str(row.get("run", "")))


def export_csv(results_dirs, out_path):
    """Write the leaderboard CSV; numbers stay numbers, missing values are empty cells. Returns the rows."""
    rows = sorted(collect(results_dirs), key=sort_key)
    names = [c for c, _ in columns()]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in names})
    return rows
