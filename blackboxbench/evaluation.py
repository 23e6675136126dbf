"""Evaluation: per-sample metrics (registry METRIC) and per-run summaries, as pure functions of records."""
import math
import statistics

import torch

from .errors import BenchError, describe
from .perceptual import lpips_distance, ssim
from .registry import METRIC, block_label
from .stats import averaged_rate_interval, mean_interval, median_interval, wilson
from .threat import flat_norm

LPIPS_MIN_SIDE = 32  # LPIPS (AlexNet) on smaller images upsamples them to this side first


@METRIC.register("l2", better="lower")
def l2(x_adv, x):
    return flat_norm(x_adv - x, "l2")


@METRIC.register("linf", better="lower")
def linf(x_adv, x):
    return flat_norm(x_adv - x, "linf")


PERCEPTUAL = (("ssim", "higher"), ("lpips", "lower"))  # the perceptual cost every record carries


def distances(x_adv, x):
    """{metric name: (N,) list of floats} for every registered metric (a plugin's too); a non-finite value (NaN:
    undefined for that image) is recorded as None and left out of the summary's mean and median. A metric that does
    not return one number per image is a one-line error naming it and its file."""
    out = {}
    with torch.no_grad():
        for name in METRIC.names():
            fn = METRIC.get(name)
            v = fn(x_adv, x)
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != (x.shape[0],):
                raise BenchError(f"metric {block_label(fn)} must return a tensor of shape ({x.shape[0]},), one "
                                 f"value per image; got {describe(v)}")
            out[name] = [d if math.isfinite(d) else None for d in v.float().cpu().tolist()]  # NaN: no value
    return out


def sample_metrics(x_adv, x, lpips_net=None):
    """{metric name: (N,) list of floats} for every registered metric, plus the perceptual cost: ``ssim`` and
    ``lpips`` (None for every sample when ``lpips_net`` is None: its weights are absent)."""
    out = distances(x_adv, x)
    with torch.no_grad():
        out["ssim"] = ssim(x_adv, x).cpu().tolist()
        out["lpips"] = lpips_distance(lpips_net, *lpips_size(x_adv, x)).cpu().tolist() \
            if lpips_net is not None else [None] * x.shape[0]
    return out


def metric_columns():
    """[(summary column, direction)] of every registered metric and the perceptual cost: ``mean_<m>`` and
    ``median_<m>``, in the direction the metric declared at registration (``better``; None: not ranked)."""
    named = [(m, METRIC.get(m).registry_meta.get("better")) for m in METRIC.names()] + list(PERCEPTUAL)
    return [(f"{stat}_{m}", better) for m, better in named for stat in ("mean", "median")]


def check_metric_names(fields, columns, family):
    """A registered metric must not overwrite what a run writes: a field of the family's records (``queries``,
    ``index``...), the record checksum or an internal ``_`` field, or a summary column (``mean_drop_map``); a
    one-line error naming the metric and its file."""
    for name in (n for n in METRIC.names() if n not in ("l2", "linf")):  # the built-in record fields
        summary = sorted({f"mean_{name}", f"median_{name}"} & set(columns))
        if name in fields or name == "check":
            clash = f"'{name}' is a field of the {family} family's records"
        elif not name.isidentifier() or name.startswith("_"):
            clash = f"'{name}' is not a plain name"
        elif summary:
            clash = f"its summary column '{summary[0]}' is one of the {family} family's"
        else:
            continue
        raise BenchError(f"metric {block_label(METRIC.get(name))}: {clash}; register the metric under another name")


def distortion_summary(records):
    """Mean and median of every metric the records carry (the registered ones and SSIM / LPIPS; None where no
    record has a value), and ``metrics``: the names of the metrics summarized, for the leaderboard's columns."""
    names = METRIC.names() + [m for m, _ in PERCEPTUAL]
    out = {"metrics": names}
    for m in names:
        v = [r[m] for r in records if r.get(m) is not None]
        out.update({f"mean_{m}": _mean(v), f"median_{m}": _median(v)})
    return out


def lpips_size(*images, side=LPIPS_MIN_SIDE):
    """Images smaller than ``side`` pixels, upsampled (bilinear) to it: AlexNet's pooling needs at least 32 x 32
    (the 8 x 8 digits, 28 x 28 MNIST); larger images pass unchanged."""
    h, w = images[0].shape[-2:]
    if min(h, w) >= side:
        return images
    size = (max(side, h), max(side, w))
    return tuple(torch.nn.functional.interpolate(x.float(), size=size, mode="bilinear", align_corners=False)
                 for x in images)


def _mean(v):
    return float(sum(v) / len(v)) if v else None


def _median(v):
    return float(statistics.median(v)) if v else None


def _ratio(a, b):
    return a / b if b else None


def _interval(name, bounds):
    return {f"{name}_low": bounds[0], f"{name}_high": bounds[1]}


def _averaged_interval(attacked, names):
    """The interval of the transfer family's averaged ASR: every attacked sample, per target its success and
    whether it counts (the target classifies it correctly when clean)."""
    success = [[r["targets"][t]["success"] for t in names] for r in attacked]
    valid = [[r["targets"][t]["clean_correct"] for t in names] for r in attacked]
    return averaged_rate_interval(success, valid) if attacked and names else (None, None)


def summarize_query(records):
    """Clean accuracy, ASR over attacked samples (success = the oracle's confirmation), AQN/MQN over successes,
    each with its 95 % interval (:mod:`blackboxbench.stats`: Wilson, bootstrap, sign test), distortion over
    successes; the audit's disagreements (its own forward of the returned image says otherwise) and stalled samples
    are counted, never folded into the success rate."""
    n = len(records)
    attacked = [r for r in records if r["attacked"]]
    wins = [r for r in attacked if r["success"]]
    q = [r["queries"] for r in wins]
    rules = sorted({r["success_rule"] for r in records})  # every record states it (a run may attack none)
    defended = [r for r in records if r.get("clean_correct_defended") is not None]
    reeval = [r for r in attacked if r.get("reeval_adv") is not None]
    n_reeval = sum(r["reeval_adv"] for r in reeval)
    return {
        "n": n, "clean_acc": _ratio(sum(r["clean_correct"] for r in records), n),
        "n_attacked": len(attacked), "n_success": len(wins), "asr": _ratio(len(wins), len(attacked)),
        **_interval("asr", wilson(len(wins), len(attacked))),
        "n_audit_disagree": sum(r["audit_adv"] != r["success"] for r in attacked),
        "n_stalled": sum(r["stalled"] for r in attacked), "success_rule": ", ".join(rules) or None,
        "aqn": _mean(q), **_interval("aqn", mean_interval(q)),
        "mqn": _median(q), **_interval("mqn", median_interval(q)),
        "mean_queries_all": _mean([r["queries"] for r in attacked]),
        **distortion_summary(wins),
        # Defenses (defense.py): the target's defense, EOT, clean accuracy under the defense; the defended
        # (majority-of-k draws, evaluation streams) and undefended (the audit) re-evaluations of the returned
        # images, as success rates over attacked samples; reeval_gap = recorded successes - defended confirmations.
        "defense": ", ".join(sorted({r["defense"] for r in records if r.get("defense")})) or None,
        "eot": max([r.get("eot", 1) for r in records], default=1),
        "clean_acc_defended": _ratio(sum(r["clean_correct_defended"] for r in defended), len(defended)),
        "asr_reeval_defended": _ratio(n_reeval, len(reeval)) if reeval else None,
        "asr_reeval_undefended": _ratio(sum(bool(r["audit_adv"]) for r in attacked), len(attacked)),
        "reeval_gap": len(wins) - n_reeval if reeval else None,
        # sample-seconds: each record's time is its latency in a slot, the slots sharing the model's calls
        "attack_time": sum(r["time"] for r in records),
    }


def _target_average_interval(per_target, attacked):
    """The averaged ASR's interval: with one target that has valid samples, the average is that target's ASR and
    the interval its Wilson interval (as in ``per_target``); with several, the bootstrap over images."""
    counted = [t for t, v in per_target.items() if v["asr"] is not None]
    if len(counted) == 1:
        return per_target[counted[0]]["asr_low"], per_target[counted[0]]["asr_high"]
    return _averaged_interval(attacked, list(per_target))


def _audit_disagreements(records, target):
    """How many attacked samples' verdict of ``target`` its audit (``family.audit_logits``) contradicts;
    records written before the audit, and defended targets, have none (``audit_adv`` absent or None)."""
    return sum(r["targets"][target].get("audit_adv") not in (None, r["targets"][target]["success"])
               for r in records if r["attacked"])


def summarize_transfer(records):
    """Per target: clean accuracy and ASR over the samples that target classifies correctly when clean (with its
    Wilson interval); ``asr`` is their average over targets (the paper's "averaged ASR", Sec. IV-B), its interval
    a bootstrap over the images (one resample serves every target: they share the images)."""
    n = len(records)
    names = list(records[0]["targets"]) if records else []
    per_target = {}
    for t in names:
        valid = [r for r in records if r["attacked"] and r["targets"][t]["clean_correct"]]
        per_target[t] = {"clean_acc": _ratio(sum(r["targets"][t]["clean_correct"] for r in records), n),
                         "asr": _ratio(wins := sum(r["targets"][t]["success"] for r in valid), len(valid)),
                         **_interval("asr", wilson(wins, len(valid))),
                         "n": len(valid), "defense": records[0]["targets"][t].get("defense", "none"),
                         "n_audit_disagree": _audit_disagreements(records, t)}
    asrs = [v["asr"] for v in per_target.values() if v["asr"] is not None]
    attacked = [r for r in records if r["attacked"]]
    return {
        "n": n, "clean_acc": _mean([v["clean_acc"] for v in per_target.values() if v["clean_acc"] is not None]),
        "surrogate_clean_acc": _ratio(sum(r["clean_correct"] for r in records), n),
        "n_attacked": len(attacked), "n_audit_disagree": sum(v["n_audit_disagree"] for v in per_target.values()),
        "asr": _mean(asrs), **_interval("asr", _target_average_interval(per_target, attacked)),
        "per_target": per_target, "aqn": None, "mqn": None,
        **distortion_summary(attacked),
        "defense": ", ".join(f"{t}={v['defense']}" for t, v in per_target.items() if v["defense"] != "none")
        or "none",
        "attack_time": sum(r["time"] for r in records),
    }
