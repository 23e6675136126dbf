"""Leaderboard: every run under a results directory -> one CSV row per run.

Columns: the common ones, then each family's declared columns (with their direction, see
:mod:`blackboxbench.family`), then run metadata. Rows are sorted by the :data:`SORT_BY` columns, each in its
declared direction (ASR higher first, then AQN lower first); a missing or non-finite value sorts last; then by
run name.

A run that cannot be exported (no ``summary.json`` yet, or one that is not a summary) never stops the export: it
is listed in the skipped runs with a one-line reason. Text cells that a spreadsheet would read as a formula are
written with a leading ``'``.
"""
import csv
import io
import json
import math
from pathlib import Path
from typing import NamedTuple

from .errors import BenchError
from .evaluation import metric_columns
from .family import COMMON_COLUMNS, TRAILING_COLUMNS
from .registry import FAMILY

SORT_BY = ("asr", "aqn")
MARKERS = ("summary.json", "config.yaml", "records.jsonl")  # the files that make a directory a run directory
# Fields every summary has, with their JSON types; a null ASR is a run without attacked samples (sorts last).
REQUIRED = {"attack": ((str,), "a string"), "family": ((str,), "a string"),
            "asr": ((int, float, type(None)), "a number or null")}
UNFINISHED = "unfinished (no summary.json); re-run its config to finish it"
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",  # json.loads
              float: "a number", type(None): "null"}


class Skipped(NamedTuple):
    """A run left out of the leaderboard, and why."""

    run: Path
    reason: str

    def __str__(self):
        return f"skipped {self.run}: {self.reason}"


def columns(rows=()):
    """[(column, direction)] of the CSV: common columns, every family's declared columns, the mean and median of
    every registered metric (a plugin's, :func:`blackboxbench.evaluation.metric_columns`) and of the metrics the
    ``rows`` summarized (a plugin not imported here: not ranked), run metadata."""
    out = {c: None for c in COMMON_COLUMNS}
    for name in FAMILY.names():
        for col, direction in FAMILY.get(name).columns:
            out.setdefault(col, direction)
    for col, direction in metric_columns():
        out.setdefault(col, direction)
    for m in summarized_metrics(rows):
        out.setdefault(f"mean_{m}", None)
        out.setdefault(f"median_{m}", None)
    out.update({c: None for c in TRAILING_COLUMNS if c not in out})
    return list(out.items())


def summarized_metrics(rows):
    """The metric names the ``rows``' summaries list (their ``metrics``), each once, in order of appearance."""
    names = {}
    for r in rows:
        listed = r.get("metrics")
        names.update((m, None) for m in (listed if isinstance(listed, list) else []) if isinstance(m, str))
    return list(names)


def run_dirs(results_dirs):
    """Every run directory (one holding a :data:`MARKERS` file) below the results directory (or directories),
    once each, sorted."""
    roots = [Path(results_dirs)] if isinstance(results_dirs, (str, Path)) else [Path(d) for d in results_dirs]
    for root in roots:
        if not root.is_dir():
            raise BenchError(f"results directory {'is not a directory' if root.exists() else 'not found'}: {root}")
    found = {}
    for root in roots:
        for marker in MARKERS:
            for p in root.rglob(marker):
                found.setdefault(p.parent.resolve(), p.parent)
    return sorted(found.values())


def read_summary(run_dir):
    """``(summary, None)`` for a finished run, ``(None, reason)`` for a run that cannot be exported."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None, UNFINISHED
    try:
        s = json.loads(path.read_bytes().decode("utf-8-sig"))
        json.dumps(s, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape ("\ud800") is not text
    except OSError as e:
        return None, f"summary.json cannot be read ({e.strerror or e})"
    except UnicodeDecodeError as e:
        return None, f"summary.json is not UTF-8 text (byte {e.start})"
    except UnicodeEncodeError as e:
        return None, f"summary.json holds an unpaired surrogate escape (\\u{ord(e.object[e.start]):04x})"
    except json.JSONDecodeError as e:
        return None, f"summary.json is not valid JSON (line {e.lineno})"
    except (ValueError, RecursionError) as e:  # integers past Python's digit limit, deep nesting
        return None, f"summary.json is not valid JSON ({(str(e).splitlines() or [type(e).__name__])[0]})"
    if not isinstance(s, dict):
        return None, f"summary.json holds {JSON_KINDS[type(s)]}, not an object"
    missing = [k for k in REQUIRED if k not in s]
    if missing:
        return None, f"summary.json lacks {', '.join(missing)}"
    for k, (types, expected) in REQUIRED.items():
        if not isinstance(s[k], types) or isinstance(s[k], bool):
            return None, f"summary.json: {k} is {JSON_KINDS[type(s[k])]}, not {expected}"
    return {**s, "run": s.get("run") or Path(run_dir).name}, None


def collect(results_dirs):
    """``(summaries, skipped)``: the summary of every finished run below the results directory (or directories)
    and a :class:`Skipped` for every other run directory."""
    rows, skipped = [], []
    for d in run_dirs(results_dirs):
        s, reason = read_summary(d)
        if reason:
            skipped.append(Skipped(d, reason))
        else:
            rows.append(s)
    return rows, skipped


def label(row):
    """A run's label in tables and figures: the config's ``name`` when it gave one, else the attack."""
    return row.get("name") or row.get("attack")


# settings that can tell apart runs with one label (a figure's cell or bar, a table row): the first ones that differ
SETTING_KEYS = ("eps", "target_model", "surrogates", "defense", "success_rule", "eot", "budget", "feedback",
                "targeted", "target_label", "seed", "dataset", "dataset_params", "n", "cascade_after")


# a setting's name in a label
SETTING_NAMES = {"success_rule": "rule", "target_model": "target", "eot": "EOT", "dataset_params": "data",
                 "target_label": "targets", "cascade_after": "after"}


def _setting(key, value):
    """A setting as a label part: ``eps 8/255``, ``rule majority of 5``, ``targeted`` / ``untargeted``..."""
    if key == "eps" and is_number(value):
        return f"eps {value * 255:.3g}/255"
    if key == "targeted" and isinstance(value, bool):
        return "targeted" if value else "untargeted"
    return f"{SETTING_NAMES.get(key, key)} {value}"


def _text(value):
    return json.dumps(value, sort_keys=True, default=str)


def run_labels(rows, within=lambda r: None, clash=lambda r: None, keys=SETTING_KEYS):
    """The labels of run rows (one per run; a list in their order) for a figure or table: :func:`label`, and where
    runs of a group (same label and ``within(row)``) would still share a label and ``clash(row)`` (one cell, bar or
    row), the settings of ``keys`` in which those runs differ, added to every run of the group (so its runs stay
    comparable, e.g. ``square_linf eps 8/255``); runs that differ in none of them get their config hash."""
    groups = {}
    for i, r in enumerate(rows):
        groups.setdefault((label(r), _text(within(r))), []).append(i)
    out = [None] * len(rows)
    for (base, _), members in groups.items():
        clashing = {}
        for i in members:
            clashing.setdefault(_text(clash(rows[i])), []).append(i)
        clashing = [same for same in clashing.values() if len(same) > 1]
        differ = [k for k in keys if any(len({_text(rows[i].get(k)) for i in same}) > 1 for same in clashing)]
        for i in members:
            out[i] = base + "".join(f" {_setting(k, rows[i].get(k))}" for k in differ if rows[i].get(k) is not None)
        still = {}
        for i in members:
            still.setdefault((out[i], _text(clash(rows[i]))), []).append(i)
        for same in still.values():
            for i in same if len(same) > 1 else ():
                out[i] += f" {rows[i].get('config_hash')}"
    return out


def is_number(v):
    """A finite int or float, not a boolean."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def sort_key(row, directions):
    """Each :data:`SORT_BY` column best first by its direction (``higher`` or ``lower``), a missing or
    non-finite value last; then the run name."""
    key = [(0, -row[c] if directions.get(c) == "higher" else row[c]) if is_number(row.get(c)) else (1, 0)
           for c in SORT_BY]
    return (*key, str(row.get("run", "")))


def cell(v):
    """A CSV cell: numbers and booleans as they are, None empty, any other value as text, with a leading ``'``
    when a spreadsheet would read it as a formula, or when the text starts with ``'`` itself (the reader,
    ``plotting.read_csv``, takes one off, so that every text reads back as written)."""
    if v is None:
        return ""
    if isinstance(v, (int, float)):
        return v
    text = str(v)
    return "'" + text if text.startswith(FORMULA_START + ("'",)) else text


def to_csv(rows, names):
    """The CSV text of ``rows`` under the columns ``names`` (values outside them are left out)."""
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(names)
    w.writerows([cell(r.get(k)) for k in names] for r in rows)
    return buf.getvalue()


def export_csv(results_dirs, out_path):
    """Write the leaderboard CSV of every finished run; returns ``(rows, skipped)``: the exported summaries in
    leaderboard order and a :class:`Skipped` (one line as ``str``) for every run left out."""
    rows, skipped = collect(results_dirs)
    cols = columns(rows)
    directions = dict(cols)
    rows.sort(key=lambda r: sort_key(r, directions))
    out = Path(out_path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_csv(rows, [c for c, _ in cols]), encoding="utf-8")
    except OSError as e:
        raise BenchError(f"cannot write the leaderboard {out}: {e.strerror or e}") from None
    return rows, skipped


def notes(rows, skipped, out_path):
    """The lines to show the user after an export: one per skipped run, and a note when no run was exported."""
    empty = [f"note: no finished run to export; {out_path} holds only the header"] if not rows else []
    return [str(s) for s in skipped] + empty
