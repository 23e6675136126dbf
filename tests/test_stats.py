"""Confidence intervals of the summaries (blackboxbench/stats.py), against scipy's independent implementations, and
in the query and transfer summaries."""
import numpy as np
import pytest
from scipy.stats import binom, binomtest, bootstrap

from blackboxbench.evaluation import summarize_query, summarize_transfer
from blackboxbench.stats import averaged_rate_interval, mean_interval, median_interval, wilson


@pytest.mark.parametrize("k,n", [(0, 1), (0, 10), (3, 10), (87, 100), (100, 100), (1, 300), (150, 300)])
def test_wilson_matches_scipy(k, n):
    ci = binomtest(k, n).proportion_ci(method="wilson")
    assert wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)


def test_wilson_of_nothing_is_no_interval():
    assert wilson(0, 0) == (None, None)


@pytest.mark.parametrize("n", [1, 5, 6, 7, 12, 20, 31, 100, 10_000])
def test_median_interval_is_the_widest_sign_test_interval_at_95(n):
    values = [float(v) for v in range(n)][::-1]  # unsorted on purpose
    lo, hi = median_interval(values)
    if n < 6:  # P(Bin(n, 1/2) = 0) > 0.025: no interval of two order statistics reaches 95 %
        assert (lo, hi) == (None, None) and 2 * binom.pmf(0, n, 0.5) > 0.05
        return
    k = int(lo) + 1  # the interval is (x_(k), x_(n+1-k)), 1-based
    assert hi == n - k
    assert 1 - 2 * binom.cdf(k - 1, n, 0.5) >= 0.95
    assert 1 - 2 * binom.cdf(k, n, 0.5) < 0.95


def test_mean_interval_agrees_with_scipy_bootstrap():
    """Heavy-tailed query counts: the percentile bootstrap of the mean, within the resampling noise of scipy's
    (2,000 draws each, different generators)."""
    v = np.random.default_rng(1).exponential(300.0, 80)
    ci = bootstrap((v,), np.mean, method="percentile", n_resamples=2000, random_state=0).confidence_interval
    lo, hi = mean_interval(v)
    width = ci.high - ci.low
    assert lo == pytest.approx(ci.low, abs=0.05 * width) and hi == pytest.approx(ci.high, abs=0.05 * width)
    assert lo < v.mean() < hi
    assert mean_interval(v) == (lo, hi)  # a fixed seed: the same summary every time
    assert mean_interval([5.0]) == (None, None)


def test_averaged_rate_interval():
    """One target, every sample valid: the bootstrap of a proportion, close to Wilson's interval at n = 100;
    two targets that share the images: the interval holds the average and is narrower than the union of the
    per-target intervals; a target with no valid sample in a resample is left out of that resample's average."""
    s = np.arange(100) < 60
    lo, hi = averaged_rate_interval(s[:, None], np.ones((100, 1), bool))
    w = wilson(60, 100)
    assert lo == pytest.approx(w[0], abs=0.02) and hi == pytest.approx(w[1], abs=0.02)
    rng = np.random.default_rng(2)
    success, valid = rng.random((200, 2)) < [0.3, 0.7], rng.random((200, 2)) < 0.9
    rates = [success[valid[:, j], j].mean() for j in range(2)]
    lo, hi = averaged_rate_interval(success, valid)
    assert lo < np.mean(rates) < hi and hi - lo < 0.15
    valid[:, 1] = False
    valid[0, 1] = True  # target 1 counts one image: most resamples average target 0 alone
    lo, hi = averaged_rate_interval(success, valid)
    assert lo is not None and lo < success[valid[:, 0], 0].mean() < hi + 0.5
    assert averaged_rate_interval(np.zeros((0, 2), bool), np.zeros((0, 2), bool)) == (None, None)


def _query_record(i, success, queries):
    return {"index": i, "attacked": True, "clean_correct": True, "success": success, "queries": queries,
            "audit_adv": success, "stalled": False, "success_rule": "single", "time": 0.1, "l2": 0.5, "linf": 0.03,
            "ssim": 0.9, "lpips": None}


def test_query_summary_holds_the_intervals():
    q = [3, 10, 25, 40, 41, 77, 120, 300, 900, 1500, 2000, 4000]
    records = [_query_record(i, True, v) for i, v in enumerate(q)] + [_query_record(12 + i, False, 10_000)
                                                                       for i in range(4)]
    s = summarize_query(records)
    assert s["asr"] == 0.75 and (s["asr_low"], s["asr_high"]) == pytest.approx(wilson(12, 16))
    assert s["aqn_low"] < s["aqn"] < s["aqn_high"]
    assert (s["mqn_low"], s["mqn_high"]) == median_interval(q) and s["mqn_low"] <= s["mqn"] <= s["mqn_high"]
    empty = summarize_query([])
    assert (empty["asr_low"], empty["aqn_low"], empty["mqn_low"]) == (None, None, None)


def test_transfer_summary_holds_the_intervals():
    rng = np.random.default_rng(3)
    records = [{"index": i, "attacked": True, "clean_correct": True, "time": 0.1, "l2": 1.0, "linf": 0.03,
                "ssim": 0.9, "lpips": None,
                "targets": {t: {"clean_correct": bool(rng.random() < 0.9), "success": bool(rng.random() < p),
                                "defense": "none"} for t, p in (("a", 0.3), ("b", 0.8))}} for i in range(50)]
    s = summarize_transfer(records)
    for t, v in s["per_target"].items():
        wins = sum(r["targets"][t]["success"] for r in records if r["targets"][t]["clean_correct"])
        assert (v["asr_low"], v["asr_high"]) == pytest.approx(wilson(wins, v["n"]))
    assert s["asr_low"] < s["asr"] < s["asr_high"]


def test_median_interval_matches_scipy_quantile_test_with_ties():
    """Against scipy's own order-statistic interval of the median (``quantile_test(...).confidence_interval``),
    on query-like counts with many ties, at every n from 1 (no interval below 6) to 150."""
    from scipy.stats import quantile_test

    rng = np.random.default_rng(4)
    for n in range(1, 151):
        v = rng.integers(1, 40, n).astype(float)
        ci = quantile_test(v, q=float(np.median(v)), p=0.5).confidence_interval(0.95)
        lo, hi = median_interval(list(v))
        if n < 6:
            assert (lo, hi) == (None, None)
        else:
            assert (lo, hi) == (ci.low, ci.high), n


def test_wilson_matches_scipy_on_every_count_and_at_other_levels():
    for n in (1, 2, 7, 30, 101):
        for k in range(n + 1):
            ci = binomtest(k, n).proportion_ci(method="wilson")
            assert wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)
    ci = binomtest(7, 20).proportion_ci(confidence_level=0.9, method="wilson")
    assert wilson(7, 20, level=0.9) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert wilson(0, 1)[0] == 0.0 and wilson(1, 1)[1] == 1.0


def test_sign_test_matches_scipy_binomtest_on_random_counts():
    """McNemar's exact test is the two-sided binomial test of the discordant pairs at p = 1/2."""
    from blackboxbench.stats import sign_test_p

    rng = np.random.default_rng(5)
    for k1, k2 in rng.integers(0, 60, (300, 2)).tolist() + [[0, 0], [0, 7], [7, 0], [30, 30]]:
        want = binomtest(k1, k1 + k2, 0.5).pvalue if k1 + k2 else 1.0
        assert sign_test_p(k1, k2) == pytest.approx(want, rel=1e-9, abs=1e-300)


def test_query_summary_matches_a_brute_force_count():
    """Random records of a query run: misclassified samples and a cascade's skipped ones are not attacked (not in
    ASR's denominator), failures and their queries stay out of AQN / MQN and of the distortion means, the audit's
    disagreements are counted over attacked samples; each interval against scipy's reference."""
    from scipy.stats import quantile_test

    rng = np.random.default_rng(6)
    records = []
    for i in range(120):
        kind = rng.choice(["miss", "skip", "win", "fail"], p=[0.1, 0.1, 0.55, 0.25])
        attacked = kind in ("win", "fail")
        r = {"index": i, "clean_correct": kind != "miss", "attacked": bool(attacked), "success": kind == "win",
             "queries": int(rng.integers(1, 500)) if kind == "win" else (1000 if kind == "fail" else 0),
             "audit_adv": (kind == "win") != bool(rng.random() < 0.05) if attacked else None,
             "stalled": bool(attacked and rng.random() < 0.1), "success_rule": "single", "time": 0.1,
             "l2": float(rng.random()), "linf": float(rng.random()), "ssim": float(rng.random()), "lpips": None}
        if kind == "skip":
            r["fooled_by"] = "earlier"
        records.append(r)
    s = summarize_query(records)
    att = [r for r in records if r["clean_correct"] and "fooled_by" not in r]
    wins = [r for r in att if r["success"]]
    q = np.array([r["queries"] for r in wins], float)
    assert (s["n"], s["n_attacked"], s["n_success"]) == (120, len(att), len(wins))
    assert s["asr"] == len(wins) / len(att) and s["clean_acc"] == np.mean([r["clean_correct"] for r in records])
    ci = binomtest(len(wins), len(att)).proportion_ci(method="wilson")
    assert (s["asr_low"], s["asr_high"]) == pytest.approx((ci.low, ci.high), abs=1e-12)
    assert s["aqn"] == pytest.approx(q.mean()) and s["mqn"] == np.median(q)
    ci = quantile_test(q, q=float(np.median(q))).confidence_interval(0.95)
    assert (s["mqn_low"], s["mqn_high"]) == (ci.low, ci.high)
    assert s["aqn_low"] < q.mean() < s["aqn_high"]
    assert s["mean_queries_all"] == pytest.approx(np.mean([r["queries"] for r in att]))
    for m in ("l2", "linf", "ssim"):
        assert s[f"mean_{m}"] == pytest.approx(np.mean([r[m] for r in wins]))
        assert s[f"median_{m}"] == pytest.approx(np.median([r[m] for r in wins]))
    assert s["mean_lpips"] is None
    assert s["n_audit_disagree"] == sum(r["audit_adv"] != r["success"] for r in att) > 0
    assert s["n_stalled"] == sum(r["stalled"] for r in att)
    assert s["asr_reeval_undefended"] == sum(r["audit_adv"] for r in att) / len(att)


def test_bootstrap_keeps_resamples_that_define_the_statistic_when_at_least_half_do():
    """Resamples whose statistic is undefined (NaN) are left out, and the interval exists while at least half the
    resamples define it. A mean over the one valid sample of ten is defined unless that sample is never drawn
    (0.9^10 = 35 % of resamples): every defined resample gives that sample's value. Asking it drawn twice leaves
    about 74 % undefined: no interval."""
    from blackboxbench.stats import bootstrap_interval

    v, ok = np.arange(10.0) + 5, (np.arange(10) == 0).astype(float)
    assert bootstrap_interval(lambda w, v, ok: (w @ (v * ok)) / (w @ ok), [v, ok]) == (5.0, 5.0)
    twice = lambda w, v, ok: np.where(w @ ok >= 2, (w @ (v * ok)) / np.maximum(w @ ok, 1), np.nan)  # noqa: E731
    assert bootstrap_interval(twice, [v, ok]) == (None, None)


def test_query_summary_of_defended_records_matches_a_brute_force_count():
    """The defense columns of a query summary against a brute-force count: clean accuracy under the defense over
    the records that carry it, the defended re-evaluation's ASR over attacked samples, the gap (recorded successes
    minus defended confirmations), the EOT factor and the defense's name."""
    rng = np.random.default_rng(7)
    records = []
    for i in range(60):
        attacked, win = bool(rng.random() < 0.8), bool(rng.random() < 0.6)
        r = _query_record(i, attacked and win, int(rng.integers(1, 300)) if attacked else 0)
        r.update(attacked=attacked, clean_correct=attacked or bool(rng.random() < 0.5),
                 clean_correct_defended=bool(rng.random() < 0.7), defense="rnd", eot=3,
                 reeval_adv=(win and bool(rng.random() < 0.7)) if attacked else None)
        records.append(r)
    s = summarize_query(records)
    att = [r for r in records if r["attacked"]]
    wins, confirmed = sum(r["success"] for r in att), sum(r["reeval_adv"] for r in att)
    assert s["clean_acc_defended"] == pytest.approx(np.mean([r["clean_correct_defended"] for r in records]))
    assert s["asr_reeval_defended"] == pytest.approx(confirmed / len(att))
    assert s["reeval_gap"] == wins - confirmed > 0
    assert (s["eot"], s["defense"]) == (3, "rnd")
    plain = summarize_query([_query_record(0, True, 5)])
    assert (plain["eot"], plain["defense"], plain["reeval_gap"], plain["clean_acc_defended"]) == (1, None, None, None)


def test_averaged_rate_leaves_out_a_target_with_no_valid_sample_in_a_resample():
    """Target 0 is valid and fooled on every image, target 1 valid on one image only (fooled there): a resample
    without that image averages target 0 alone (1.0), one with it averages 1.0 and 1.0; every resample gives 1.0.
    Counting the absent target as a rate of 0 would pull a third of the resamples to 0.5."""
    success = np.ones((10, 2), bool)
    valid = np.ones((10, 2), bool)
    valid[1:, 1] = False
    assert averaged_rate_interval(success, valid) == (1.0, 1.0)


def test_wilson_bounds_never_leave_zero_one_by_float_noise():
    """The interval holds the observed rate and stays inside [0, 1] exactly: at k = 0 and k = n the textbook
    formula lands a rounding error outside (-5.6e-17 at 0 / 2, 1.0000000000000002 at 32 / 32), which a summary
    would report as a negative ASR bound or one above 100 %."""
    for n in range(1, 200):
        for k in (0, 1, n // 2, n - 1, n):
            lo, hi = wilson(k, n)
            assert 0.0 <= lo <= k / n <= hi <= 1.0, (k, n, lo, hi)


def test_transfer_summary_with_no_valid_sample_for_any_target_has_no_rate():
    """When no target classifies any clean image correctly, no ASR is defined: the average, its interval and each
    target's are None (not an error)."""
    records = [{"index": i, "attacked": True, "clean_correct": True, "time": 0.1, "l2": 1.0, "linf": 0.03,
                "ssim": 0.9, "lpips": None,
                "targets": {t: {"clean_correct": False, "success": False, "defense": "none"} for t in ("a", "b")}}
               for i in range(4)]
    s = summarize_transfer(records)
    assert (s["asr"], s["asr_low"], s["asr_high"]) == (None, None, None)
    assert all((v["asr"], v["asr_low"], v["n"]) == (None, None, 0) for v in s["per_target"].values())
