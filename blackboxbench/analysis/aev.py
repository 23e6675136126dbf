"""Attack-component Effect Visualization (AEV), the first five analysis tools of BlackboxBench (Tab. III; Supp.
B-1): line, scatter, bar, bubble and heatmap plots of a metric while one component of the attack scenario (method,
setting, target model, dataset) varies and the others stay fixed.

Rows come from a leaderboard CSV (``blackboxbench leaderboard``) or from the run summaries under a results
directory. There, a summary with per-target results (a transfer or detection run) gives one row per target: its
``target_model`` is the target's name and the target's own values (ASR, clean accuracy, mAP drops...) replace the
run's averages. ``where`` keeps the rows whose columns equal the given values (the fixed components).

A tool is a pure function ``tool(rows, *, x, y, ...) -> (header, table, draw)``: the numbers it plots and
``draw(path, title)``, which writes the figure. Line, bar and heatmap aggregate ``y`` over the rows that share
(``hue``, ``x``): mean, sample standard deviation and count; the error bars are mean +- std (the paper's, Figs. 8
and 21), except where one run makes the point and its summary gives ``y``'s 95 % interval (``asr_low`` /
``asr_high``, ``aqn_low`` / ``aqn_high``, ...; :mod:`blackboxbench.stats`): then the bar is that interval.
Scatter and bubble plot the rows themselves. :func:`blackboxbench.analysis.recipes.plot` runs a recipe of the
``analysis/`` catalog and writes ``<out>.png`` and ``<out>.csv``.
"""
import json
import math
import statistics
from pathlib import Path

from ..errors import BenchError
from ..leaderboard import collect, is_number, label
from ..plotting import error_bars, figure, heatmap, matrix_panel, read_csv
from ..registry import ANALYSIS, ParamError, close_matches

AGGREGATE_HEADER = ("mean", "std", "n", "low", "high")


def summary_rows(summaries):
    """One row per run summary; a summary with per-target results, one row per target (see the module docstring)."""
    rows = []
    for s in summaries:
        base = {k: v for k, v in s.items() if k != "per_target"}
        per = s.get("per_target")
        if isinstance(per, dict) and per and all(isinstance(v, dict) for v in per.values()):
            rows += [{**base, **v, "target_model": t} for t, v in per.items()]
        else:
            rows.append(base)
    return rows


def load_rows(source):
    """``(rows, skipped)`` of a leaderboard CSV or of the finished runs under a results directory or a list of
    them (``skipped``: the runs left out, :class:`~blackboxbench.leaderboard.Skipped`). Every row gets ``label``,
    the run's label in tables (:func:`~blackboxbench.leaderboard.label`: the config's ``name``, else the attack),
    the recipes' default hue: two configs of one attack under different names stay apart."""
    p = None if isinstance(source, (list, tuple)) else Path(source)
    if p is None or p.is_dir():
        summaries, skipped = collect(source)
        rows = summary_rows(summaries)
    elif p.is_file():
        rows, skipped = read_csv(p), []
    else:
        raise BenchError(f"results not found: {source} (give a leaderboard CSV or a results directory)")
    for r in rows:
        r.setdefault("label", label(r))
    return rows, skipped


def key(v):
    """A value as a group key: itself when hashable and plain, else its JSON text (a list or a mapping)."""
    return v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v, sort_keys=True, default=str)


def _same(a, b):
    if is_number(a) and is_number(b):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
    return str(a) == str(b)


def need(rows, *names):
    """Raise a one-line error unless every column in ``names`` (empty names skipped) is in some row."""
    have = set().union(*rows) if rows else set()
    for n in names:
        if n and n not in have:
            raise BenchError(f"no column '{n}' in the results{close_matches(n, have)}")


def select(rows, where):
    """The rows whose column ``k`` equals ``v`` (numbers within 1e-6 relative, else as text; a list: any of its
    values) for every ``k: v`` of ``where``."""
    need(rows, *(where or {}))
    wanted = {k: v if isinstance(v, list) else [v] for k, v in (where or {}).items()}
    return [r for r in rows if all(any(_same(r.get(k), w) for w in ws) for k, ws in wanted.items())]


def order(values):
    """The distinct values: ascending when all are numbers, else in order of first appearance."""
    distinct = list(dict.fromkeys(values))
    return sorted(distinct) if distinct and all(is_number(v) for v in distinct) else distinct


def aggregate(rows, x, y, hue=""):
    """``[{"hue", "x", "mean", "std", "n", "low", "high"}]``: ``y`` over the rows sharing (``hue``, ``x``), rows
    without a number in ``y`` or a value in ``x`` left out; sorted by hue, then x (see :func:`order`); ``std`` is
    the sample standard deviation (0 for one row); ``low`` / ``high`` the error bar: mean -+ std, or the 95 %
    interval of a group of one row that has numbers in ``<y>_low`` and ``<y>_high``."""
    need(rows, x, y, hue)
    groups = {}
    for r in rows:
        if is_number(r.get(y)) and r.get(x) is not None:
            groups.setdefault((key(r.get(hue)) if hue else "", key(r[x])), []).append(r)
    if not groups:
        raise BenchError(f"no row has a number in '{y}' and a value in '{x}'")
    hues, xs = order([h for h, _ in groups]), order([v for _, v in groups])
    out = []
    for (h, v), members in groups.items():
        vals = [float(r[y]) for r in members]
        mean, std = statistics.fmean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0
        bounds = [members[0].get(f"{y}_{end}") for end in ("low", "high")]
        low, high = map(float, bounds) if len(vals) == 1 and all(map(is_number, bounds)) else (mean - std, mean + std)
        out.append({"hue": h, "x": v, "mean": mean, "std": std, "n": len(vals), "low": low, "high": high})
    return sorted(out, key=lambda r: (hues.index(r["hue"]), xs.index(r["x"])))


def _yerr(part):
    """matplotlib's asymmetric error bars of the aggregated points ``part``."""
    return error_bars([r["mean"] for r in part], [r["low"] for r in part], [r["high"] for r in part])


def _aggregate_table(table, x, hue):
    header = ([hue] if hue else []) + [x, *AGGREGATE_HEADER]
    return header, [([r["hue"]] if hue else []) + [r["x"]] + [r[k] for k in AGGREGATE_HEADER] for r in table]


def _figure(draw_axes, x, y, hue):
    """``draw(path, title)`` for a single-axes figure drawn by ``draw_axes(ax)``."""
    def draw(path, title):
        with figure(path, (6.4, 4.2)) as (_, axes):
            ax = axes[0, 0]
            draw_axes(ax)
            ax.set_xlabel(x)
            ax.set_ylabel(y)
            ax.set_title(title, fontsize=9)
            if hue and ax.get_legend_handles_labels()[0]:
                ax.legend(title=hue, fontsize=7, title_fontsize=8)
            ax.grid(alpha=0.3)
        return path
    return draw


def _categorical_axis(ax, xs):
    ax.set_xticks(range(len(xs)), [str(v) for v in xs], rotation=30, ha="right", fontsize=8)


@ANALYSIS.register("aev_line", paper="BlackboxBench Tab. III (AEV, line); Figs. 15, 18-20, 22")
def aev_line(rows, *, x, y, hue=""):
    """Mean (error bars: see :func:`aggregate`) of ``y`` against ``x``, one line per ``hue`` value (e.g. ASR vs
    eps per attack)."""
    table = aggregate(rows, x, y, hue)
    xs = order([r["x"] for r in table])
    numeric = all(is_number(v) for v in xs)

    def axes(ax):
        for h in order([r["hue"] for r in table]):
            part = [r for r in table if r["hue"] == h]
            ax.errorbar([r["x"] if numeric else xs.index(r["x"]) for r in part], [r["mean"] for r in part],
                        yerr=_yerr(part), marker="o", capsize=3, label=str(h) if hue else None)
        if not numeric:
            _categorical_axis(ax, xs)

    return (*_aggregate_table(table, x, hue), _figure(axes, x, y, hue))


@ANALYSIS.register("aev_bar", paper="BlackboxBench Tab. III (AEV, bar); Figs. 8, 12, 21, 24")
def aev_bar(rows, *, x, y, hue=""):
    """Mean (error bars: see :func:`aggregate`) of ``y`` per ``x`` value, grouped bars per ``hue`` value (e.g. AQN
    per target model)."""
    table = aggregate(rows, x, y, hue)
    xs, hues = order([r["x"] for r in table]), order([r["hue"] for r in table])
    width = 0.8 / len(hues)

    def axes(ax):
        for k, h in enumerate(hues):
            part = [r for r in table if r["hue"] == h]
            ax.bar([xs.index(r["x"]) + (k - (len(hues) - 1) / 2) * width for r in part], [r["mean"] for r in part],
                   width, yerr=_yerr(part), capsize=2, label=str(h) if hue else None)
        _categorical_axis(ax, xs)

    return (*_aggregate_table(table, x, hue), _figure(axes, x, y, hue))


def _family_groups(rows, families, hue, x, rl, cl):
    """``(row families, column families)``: each matrix row's and column's group under ``families`` (see
    :func:`aev_heatmap`); a value without a family is a group of its own."""
    if isinstance(families, str):
        need(rows, families)
        named = {}
        for r in rows:
            if r.get(hue) is not None and r.get(families) is not None:
                named.setdefault(key(r[hue]), set()).add(key(r[families]))
        split = {h: sorted(map(str, f)) for h, f in named.items() if len(f) > 1}
        if split:
            h, f = next(iter(split.items()))
            raise ParamError("families", f"the runs of {hue} {h!r} have several values in column '{families}' "
                                         f"({', '.join(f)}): a row of the matrix needs one family")
        return [next(iter(named[h])) if h in named else h for h in rl], list(cl)
    if not isinstance(families, dict) or not families or not all(isinstance(f, str) and f for f in families.values()):
        raise ParamError("families", f"expected a mapping {{value of {hue} or {x}: family name}} or the name of a "
                                     f"column of the results, got {families!r}")
    named = {str(k): f for k, f in families.items()}
    unknown = [k for k in named if k not in {str(v) for v in (*rl, *cl)}]
    if unknown:
        raise ParamError("families", f"{unknown[0]!r} is no value of {hue} or {x} in these results"
                                     f"{close_matches(unknown[0], [str(v) for v in (*rl, *cl)])}")
    return [named.get(str(v), v) for v in rl], [named.get(str(v), v) for v in cl]


def family_matrix(m, rl, cl, rf, cf, self_pairs=True):
    """``(row families, column families, matrix)``: the mean of the present (non-NaN) cells of ``m`` (rows ``rl``,
    columns ``cl``) over each block (row family, column family), the families in order of first appearance along
    ``rf`` / ``cf`` (each row's and column's family); ``self_pairs`` false leaves out the cells whose row and column
    values are equal (a model with itself). A block without a present cell is NaN."""
    fr, fc = list(dict.fromkeys(rf)), list(dict.fromkeys(cf))
    out = [[math.nan] * len(fc) for _ in fr]
    for a, ga in enumerate(fr):
        for b, gb in enumerate(fc):
            vals = [m[i][j] for i in range(len(rl)) for j in range(len(cl)) if rf[i] == ga and cf[j] == gb
                    and not math.isnan(m[i][j]) and (self_pairs or str(rl[i]) != str(cl[j]))]
            out[a][b] = statistics.fmean(vals) if vals else math.nan
    return fr, fc, out


def _with_average(m, cl, average):
    if not average:
        return m, cl
    mean = [statistics.fmean(v) if (v := [c for c in line if not math.isnan(c)]) else math.nan for line in m]
    return [line + [a] for line, a in zip(m, mean)], cl + ["average"]


@ANALYSIS.register("aev_heatmap", paper="BlackboxBench Tab. III (AEV, heatmap); Figs. 7, 14, 25, 26, 33")
def aev_heatmap(rows, *, x, y, hue, average=True, families=None, self_pairs=True):
    """Mean of ``y`` with rows ``hue`` and columns ``x`` (e.g. transfer ASR, surrogate x target); a missing
    combination is a gray cell; ``average`` adds a column with each row's mean over its present cells (Fig. 7).
    Rows without a ``hue`` value (a query run has no surrogates) make no heatmap row.

    ``families`` averages the matrix over groups, as the second row of Figs. 14 and 33 does. The paper groups
    models, not attacks: its 12 surrogates and 12 targets are three variants of each of four architecture families
    (ResNet, ConvNeXt, ViT, Swin), and each entry of its 4 x 4 matrix averages the ASRs of one block (surrogate
    family, target family). ``families`` is a mapping {value: family name} applied to the row (``hue``) and column
    (``x``) values alike, as Fig. 14 (a value it does not name stays a group of its own, so a mapping of attack
    labels groups the rows only; a name that is no row or column value is an error); or the name of a column of the
    results holding each row's family, rows only (e.g. ``category``, the recipes' taxonomy of the attacks, with
    ``hue: label``). A family cell is the mean of the block's present cells, each of them already the mean of its
    runs, so every member counts once; ``self_pairs: false`` leaves out the cells whose row and column values are
    equal (a model attacked through itself, white-box; ``adm`` leaves them out of its AD blocks, where they are 0
    by definition). The paper says only that it averages the block's entries: by default they all count. The table
    is then the family matrix; the figure shows the member matrix and the family matrix side by side."""
    need(rows, hue)
    kept = [r for r in rows if r.get(hue) is not None]
    if not kept:  # (not "no column x": every row has x)
        raise BenchError(f"no row has a value in '{hue}', the heatmap's rows (a query run has no surrogates)")
    table = aggregate(kept, x, y, hue)
    rl, cl = order([r["hue"] for r in table]), order([r["x"] for r in table])
    m = [[math.nan] * len(cl) for _ in rl]
    for r in table:
        m[rl.index(r["hue"])][cl.index(r["x"])] = r["mean"]
    panels = [(rl, *_with_average(m, cl, average), f"{hue} \\ {x}")]
    if families is not None:
        fr, fc, fm = family_matrix(m, rl, cl, *_family_groups(rows, families, hue, x, rl, cl), self_pairs)
        panels.append((fr, *_with_average(fm, fc, average), f"{hue} \\ {x}, averaged per family"))
    rl, mat, cl, corner = panels[-1]
    header = [corner, *cl]
    body = [[h] + [None if math.isnan(v) else v for v in line] for h, line in zip(rl, mat)]
    if len(panels) == 1:
        return header, body, lambda path, title: heatmap(path, [str(v) for v in rl], [str(v) for v in cl], mat, title)

    def draw(path, title):
        width = sum(0.3 + 0.07 * max(len(str(v)) for v in r) + 1.1 * len(c) + 1.0 for r, _, c, _ in panels)
        with figure(path, (width, 1.4 + 0.45 * len(panels[0][0])), 1, 2) as (fig, axes):
            for ax, (r, mt, c, what) in zip(axes[0], panels):
                matrix_panel(fig, ax, [str(v) for v in r], [str(v) for v in c], mt, f"{title}: {what}")
        return path

    return header, body, draw


def _points(rows, columns):
    need(rows, *columns)
    keep = [r for r in rows if all(is_number(r.get(c)) for c in columns[1:] if c)]
    if not keep:
        raise BenchError(f"no row has numbers in all of {', '.join(repr(c) for c in columns[1:] if c)}")
    return keep


@ANALYSIS.register("aev_scatter", paper="BlackboxBench Tab. III (AEV, scatter); Figs. 5a, 9")
def aev_scatter(rows, *, x, y, hue=""):
    """One point per row, ``y`` against ``x``, coloured by ``hue`` (e.g. ASR against AQN per attack)."""
    pts = _points(rows, (hue, x, y))
    hues = order([key(r.get(hue)) if hue else "" for r in pts])

    def axes(ax):
        for h in hues:
            part = [r for r in pts if (key(r.get(hue)) if hue else "") == h]
            ax.scatter([r[x] for r in part], [r[y] for r in part], label=str(h) if hue else None)

    header = ([hue] if hue else []) + [x, y, "run"]
    return header, [([r.get(hue)] if hue else []) + [r[x], r[y], r.get("run")] for r in pts], _figure(axes, x, y, hue)


@ANALYSIS.register("aev_bubble", paper="BlackboxBench Tab. III (AEV, bubble); Figs. 5b-c, 6b-c")
def aev_bubble(rows, *, x, y, size, hue=""):
    """One bubble per row at (``x``, ``y``), its area growing linearly with ``size`` (20 to 500 points^2 over the
    rows' range), coloured by ``hue``."""
    pts = _points(rows, (hue, x, y, size))
    lo, hi = min(r[size] for r in pts), max(r[size] for r in pts)
    area = {id(r): 20 + 480 * ((r[size] - lo) / (hi - lo) if hi > lo else 0.5) for r in pts}
    hues = order([key(r.get(hue)) if hue else "" for r in pts])

    def axes(ax):
        for h in hues:
            part = [r for r in pts if (key(r.get(hue)) if hue else "") == h]
            ax.scatter([r[x] for r in part], [r[y] for r in part], s=[area[id(r)] for r in part], alpha=0.6,
                       label=str(h) if hue else None)

    header = ([hue] if hue else []) + [x, y, size, "run"]
    body = [([r.get(hue)] if hue else []) + [r[x], r[y], r[size], r.get("run")] for r in pts]
    return header, body, _figure(axes, x, y, hue)
