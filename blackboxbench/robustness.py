"""The robustness leaderboard: ASR and mean queries per attack x defense, one CSV and a PNG bar chart.

Built from the same summaries as the leaderboard (:func:`blackboxbench.leaderboard.collect`), query runs only. A row
is one (attack, norm, eps, targeted, target labels, defense) with its target model; the ``defense`` cell is the
summary's (``none``, ``rnd(sigma=0.02)``, ``aaa_linear(...)``, ``at`` for an adversarially trained target, ...).
Besides ASR and AQN (mean queries over successes) it keeps the mean queries over all attacked samples (a defense
that makes an attack fail also spends its budget), the clean accuracy with and without the defense, the defended
majority-of-5 re-evaluation, the perceptual cost (mean SSIM and LPIPS over successes) and the mean of every other
metric the summaries hold (L2, Linf, a plugin's). Its last columns name the run (``config_hash`` and the run
directory), so that the runs of an older version of a recipe or config left in the same results directory are told
apart from the current ones.
"""
import math
from pathlib import Path

from .errors import BenchError
from .leaderboard import collect, run_labels, summarized_metrics, to_csv
from .plotting import error_bars

COLUMNS = ("attack", "name", "family", "norm", "eps", "targeted", "target_label", "target_model", "defense",
           "n_attacked", "asr", "asr_low", "asr_high", "aqn", "aqn_low", "aqn_high", "mqn", "mean_queries_all",
           "clean_acc", "clean_acc_defended", "asr_reeval_defended", "asr_reeval_undefended", "reeval_gap",
           "success_rule", "eot", "mean_ssim", "mean_lpips", "wall_time", "config_hash", "run")
QUERY_FAMILIES = ("score", "decision")


def short_defense(text):
    """``rnd(sigma=0.02)`` -> ``rnd``; ``at+rnd(...)`` -> ``at+rnd``: the chart's legend."""
    return "+".join(part.split("(")[0] for part in str(text or "none").split("+"))


def _order(rows):
    """Rows by attack, then defense: ``none`` first, adversarially trained targets last, the others by name."""
    defenses = sorted({r.get("defense") or "none" for r in rows},
                      key=lambda d: (d != "none", d == "at" or d.startswith("at+"), d))
    rank = {d: i for i, d in enumerate(defenses)}
    return sorted(rows, key=lambda r: (str(r.get("attack")), str(r.get("norm")), float(r.get("eps") or 0),
                                       bool(r.get("targeted")), rank[r.get("defense") or "none"]))


def columns(rows):
    """:data:`COLUMNS`, with the mean of every other metric the ``rows``' summaries hold (a plugin's, e.g.
    ``mean_l1dist``) before the three columns that name the run."""
    extra = tuple(f"mean_{m}" for m in summarized_metrics(rows) if f"mean_{m}" not in COLUMNS)
    return COLUMNS[:-3] + extra + COLUMNS[-3:]


def robustness_rows(results_dirs):
    """``(rows, skipped)``: the query runs' summaries below the results directory (or directories), ordered by
    attack, then defense (``none`` first, adversarially trained targets last)."""
    rows, skipped = collect(results_dirs)
    return _order([r for r in rows if r.get("family") in QUERY_FAMILIES]), skipped


def chart_path(out_csv):
    """The chart's path next to the robustness CSV ``out_csv`` (its .png); a .png given as the CSV's path would be
    overwritten by its own chart: a one-line error."""
    if Path(out_csv).suffix.lower() == ".png":
        raise BenchError(f"the robustness output is the CSV's path; its chart is written next to it as .png (got "
                         f"{out_csv})")
    return Path(out_csv).with_suffix(".png")


def export(results_dirs, out_csv, png=None):
    """Write the robustness leaderboard CSV (and, when ``png`` is given and a query run was found, its bar chart);
    returns ``(rows, skipped)``."""
    rows, skipped = robustness_rows(results_dirs)
    out = Path(out_csv)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_csv(rows, columns(rows)), encoding="utf-8")
        if png is not None and rows:
            chart(rows, png)
    except OSError as e:
        raise BenchError(f"cannot write the robustness leaderboard {out}: {e.strerror or e}") from None
    return rows, skipped


def chart(rows, png):
    """Grouped bars: ASR (top) and mean queries over successes (bottom) per attack, one bar per defense, with the
    runs' 95 % intervals as error bars where their summaries have them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = run_labels(rows, within=lambda r: r.get("norm"), clash=lambda r: short_defense(r.get("defense")))
    group = [f"{name} {r.get('norm')}" for name, r in zip(names, rows)]  # one group of bars
    attacks = list(dict.fromkeys(group))
    defenses = list(dict.fromkeys(short_defense(r.get("defense")) for r in rows))
    value = {(g, short_defense(r.get("defense"))): r for g, r in zip(group, rows)}
    width = 0.8 / max(len(defenses), 1)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(attacks) * max(len(defenses), 1) * 0.35 + 3), 7),
                             sharex=True)
    for j, d in enumerate(defenses):
        xs = [i + (j - (len(defenses) - 1) / 2) * width for i in range(len(attacks))]
        for ax, key in zip(axes, ("asr", "aqn")):
            cells = [value.get((a, d), {}) for a in attacks]
            vals = [r.get(key) for r in cells]
            vals = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in vals]
            yerr = error_bars(vals, [r.get(f"{key}_low") for r in cells], [r.get(f"{key}_high") for r in cells])
            ax.bar(xs, vals, width, yerr=yerr, capsize=1.5, error_kw={"elinewidth": 0.6}, label=d)
    axes[0].set_ylabel("ASR")
    axes[0].set_ylim(0, 1.05)
    axes[1].set_ylabel("mean queries (successes)")
    axes[1].set_yscale("symlog")
    axes[1].set_xticks(range(len(attacks)))
    axes[1].set_xticklabels(attacks, rotation=60, ha="right", fontsize=8)
    axes[0].legend(ncol=min(len(defenses), 5), fontsize=8)
    fig.tight_layout()
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
