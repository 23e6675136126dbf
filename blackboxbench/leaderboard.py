"""Leaderboard: every run under a results directory -> one CSV row per run, sorted by ASR then AQN."""
import csv
import json
from pathlib import Path

from .errors import BenchError

COLUMNS = ["attack", "family", "dataset", "target_model", "surrogates", "norm", "eps", "targeted", "budget", "n",
           "clean_acc", "asr", "aqn", "mqn", "mean_l2", "median_l2", "mean_linf", "median_linf", "wall_time",
           "seed", "config_hash", "version", "run"]


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


def sort_key(row):
    """Higher ASR first, then fewer queries (runs without queries last among equals)."""
    asr = row.get("asr")
    aqn = row.get("aqn")
    return (-(asr if asr is not None else -1.0), aqn if aqn is not None else float("inf"), row.get("run", ""))


def export_csv(results_dirs, out_path):
    """Write the leaderboard CSV; numbers stay numbers, missing values are empty cells. Returns the rows."""
    rows = sorted(collect(results_dirs), key=sort_key)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in COLUMNS})
    return rows
