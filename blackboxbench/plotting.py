"""Figure helpers shared by the reports (detection, robustness) and the analysis tools: a figure written and closed
in one block, a grid of panels, a labelled heatmap, asymmetric error bars, and the rows of a CSV the library wrote
(numbers read back as numbers)."""
import csv
import json
import math
import textwrap
from contextlib import contextmanager

from .errors import BenchError


@contextmanager
def figure(path, size, rows=1, cols=1):
    """A matplotlib figure of ``rows`` x ``cols`` axes (a 2-D array) of ``size`` inches, written to ``path`` and
    closed when the block ends (the Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def error_bars(values, lows, highs):
    """matplotlib's asymmetric ``yerr`` of bars at ``values`` spanning ``lows`` .. ``highs``; a missing or
    non-finite bound, or one on the wrong side of its value, draws no bar on that side."""
    def side(a, b):
        ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b))
        return max(0.0, b - a) if ok else 0.0
    return [[side(lo, v) for v, lo in zip(values, lows)], [side(v, hi) for v, hi in zip(values, highs)]]


def grid_figure(path, title, panels, draw_panel, cols=4):
    """Write a figure of one panel per item of ``panels`` (``cols`` a row), each drawn by ``draw_panel(ax, item)``."""
    cols = min(cols, len(panels))
    rows = math.ceil(len(panels) / cols)
    with figure(path, (3.4 * cols, 3.1 * rows), rows, cols) as (fig, axes):
        for ax, panel in zip(axes.flat, panels):
            draw_panel(ax, panel)
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle(title, fontsize=9)
    return path


def heatmap(path, rlabels, clabels, m, title, fmt="{:.2f}", cmap="viridis"):
    """A heatmap of the matrix ``m`` (rows ``rlabels``, columns ``clabels``) with each finite value written in its
    cell; NaN cells (missing or incompatible) are light gray. Returns ``path``."""
    label_w = 0.3 + 0.07 * max([len(str(r)) for r in rlabels] + [0])  # inches of the row labels at 8 pt
    label_h = 0.2 + 0.045 * max([len(str(c)) for c in clabels] + [0])  # the column labels, slanted 35 degrees
    with figure(path, (label_w + 1.1 * len(clabels) + 1.0, label_h + 0.8 + 0.45 * len(rlabels))) as (fig, axes):
        matrix_panel(fig, axes[0, 0], rlabels, clabels, m, title, fmt, cmap)
    return path


def matrix_panel(fig, ax, rlabels, clabels, m, title, fmt="{:.2f}", cmap="viridis"):
    """Draw the matrix ``m`` on ``ax`` as :func:`heatmap` does, with its colour bar."""
    import matplotlib
    import numpy as np

    a = np.array(m, dtype=float).reshape(len(rlabels), len(clabels))
    colors = matplotlib.colormaps[cmap].with_extremes(bad="lightgray")
    im = ax.imshow(np.ma.masked_invalid(a), cmap=colors, aspect="auto")
    ax.set_xticks(range(len(clabels)), clabels, rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(rlabels)), rlabels, fontsize=8)
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            if np.isfinite(a[i, j]):
                light = im.norm(a[i, j]) > 0.6  # both colour maps used here end light: dark text there
                ax.text(j, i, fmt.format(a[i, j]), ha="center", va="center", fontsize=7, color="k" if light else "w")
    # wrapped to what fits above the matrix and its colour bar (about 10 characters an inch at 9 pt)
    ax.set_title(textwrap.fill(title, max(16, int((1.1 * len(clabels) + 1.4) * 10))), fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)


def _value(text):
    """A CSV cell as the library wrote it: a number back as one, ``True`` / ``False`` as booleans, an empty cell as
    None, a cell with the leading ``'`` of a formula-like text without it, any other text as it is."""
    if text == "" or text is None:
        return None
    if text in ("True", "False"):
        return text == "True"
    if text.startswith("'"):
        return text[1:]
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, (int, float, bool)) else text


def read_csv(path):
    """The rows of a CSV (a leaderboard or a report) as dicts, values parsed by :func:`_value`."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader, rows = csv.DictReader(f), []
            for r in reader:
                if None in r:  # cells past the header's: not a table (e.g. a YAML config given as the results)
                    raise BenchError(f"{path}: line {reader.line_num} has more cells than the header's "
                                     f"{len(reader.fieldnames)}: not a leaderboard or report CSV")
                rows.append({k: _value(v) for k, v in r.items()})
            return rows
    except OSError as e:
        raise BenchError(f"cannot read {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise BenchError(f"{path} is not a UTF-8 CSV file ({e})") from None
