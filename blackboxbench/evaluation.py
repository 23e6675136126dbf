"""Evaluation: per-sample metrics (registry METRIC) and per-run summaries, as pure functions of records."""
import statistics

import torch

from .registry import METRIC
from .threat import flat_norm


@METRIC.register("l2")
def l2(x_adv, x):
    return flat_norm(x_adv - x, "l2")


@METRIC.register("linf")
def linf(x_adv, x):
    return flat_norm(x_adv - x, "linf")


def sample_metrics(x_adv, x):
    """{metric name: (N,) list of floats} for every registered metric."""
    with torch.no_grad():
        return {name: METRIC.get(name)(x_adv, x).float().cpu().tolist() for name in METRIC.names()}


def _mean(v):
    return float(sum(v) / len(v)) if v else None


def _median(v):
    return float(statistics.median(v)) if v else None


def _ratio(a, b):
    return a / b if b else None


def summarize_query(records):
    """Clean accuracy, ASR over attacked samples (success = the oracle's confirmation), AQN/MQN over successes,
    distortion over successes; the audit's disagreements (its own forward of the returned image says otherwise)
    and stalled samples are counted, never folded into the success rate."""
    n = len(records)
    attacked = [r for r in records if r["attacked"]]
    wins = [r for r in attacked if r["success"]]
    q = [r["queries"] for r in wins]
    rules = sorted({r["success_rule"] for r in attacked})
    return {
        "n": n, "clean_acc": _ratio(sum(r["clean_correct"] for r in records), n),
        "n_attacked": len(attacked), "n_success": len(wins), "asr": _ratio(len(wins), len(attacked)),
        "n_audit_disagree": sum(r["audit_adv"] != r["success"] for r in attacked),
        "n_stalled": sum(r["stalled"] for r in attacked), "success_rule": ", ".join(rules) or None,
        "aqn": _mean(q), "mqn": _median(q),
        "mean_queries_all": _mean([r["queries"] for r in attacked]),
        "mean_l2": _mean([r["l2"] for r in wins]), "median_l2": _median([r["l2"] for r in wins]),
        "mean_linf": _mean([r["linf"] for r in wins]), "median_linf": _median([r["linf"] for r in wins]),
        "attack_time": sum(r["time"] for r in records),
    }


def summarize_transfer(records):
    """Per target: clean accuracy and ASR over the samples that target classifies correctly when clean;
    ``asr`` is their average over targets (the paper's "averaged ASR", Sec. IV-B)."""
    n = len(records)
    names = list(records[0]["targets"]) if records else []
    per_target = {}
    for t in names:
        valid = [r for r in records if r["attacked"] and r["targets"][t]["clean_correct"]]
        per_target[t] = {"clean_acc": _ratio(sum(r["targets"][t]["clean_correct"] for r in records), n),
                         "asr": _ratio(sum(r["targets"][t]["success"] for r in valid), len(valid)),
                         "n": len(valid)}
    asrs = [v["asr"] for v in per_target.values() if v["asr"] is not None]
    attacked = [r for r in records if r["attacked"]]
    return {
        "n": n, "clean_acc": _mean([v["clean_acc"] for v in per_target.values() if v["clean_acc"] is not None]),
        "surrogate_clean_acc": _ratio(sum(r["clean_correct"] for r in records), n),
        "n_attacked": len(attacked), "asr": _mean(asrs), "per_target": per_target, "aqn": None, "mqn": None,
        "mean_l2": _mean([r["l2"] for r in attacked]), "median_l2": _median([r["l2"] for r in attacked]),
        "mean_linf": _mean([r["linf"] for r in attacked]), "median_linf": _median([r["linf"] for r in attacked]),
        "attack_time": sum(r["time"] for r in records),
    }
