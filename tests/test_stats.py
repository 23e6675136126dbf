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
