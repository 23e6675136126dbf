"""Confidence intervals of the figures a summary reports (pure functions; 95 % unless told).

* :func:`wilson`: a success rate ``k / n`` (ASR). The Wilson score interval (Wilson 1927): it stays inside [0, 1]
  and keeps its coverage near 0 and 1, where a run of 100 images often sits (the normal approximation does not).
* :func:`median_interval`: a median (MQN). The sign-test interval: order statistics, distribution-free.
* :func:`bootstrap_interval`: anything else (AQN, a mean of heavy-tailed query counts; the transfer family's ASR
  averaged over targets, whose targets share the images). The percentile bootstrap over samples, from a fixed
  seed, so a summary is the same every time it is made from the same records.
* :func:`sign_test_p`: the exact sign test, for paired comparisons of two runs (:mod:`blackboxbench.compare`).

An interval is ``(low, high)``, or ``(None, None)`` where the data are too few to give one.
"""
import math
import warnings
from statistics import NormalDist

import numpy as np

LEVEL = 0.95
BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_SEED = 0
_CHUNK = 1 << 22  # resampled values held at once


def _z(level):
    return NormalDist().inv_cdf(0.5 + level / 2)


def wilson(k, n, level=LEVEL):
    """Wilson score interval of the proportion ``k / n``."""
    if not n:
        return None, None
    z2 = _z(level) ** 2
    centre = (k + z2 / 2) / (n + z2)
    half = math.sqrt(z2) / (n + z2) * math.sqrt(k * (n - k) / n + z2 / 4)
    # at k = 0 (k = n) the bound is exactly 0 (1); the formula lands a rounding error either side of it, which
    # would put a 0 % (100 %) rate outside its own interval
    return 0.0 if k == 0 else max(0.0, centre - half), 1.0 if k == n else min(1.0, centre + half)


def median_interval(values, level=LEVEL):
    """The sign-test interval of the median of ``values``: the order statistics x_(k) and x_(n+1-k) with the
    largest k such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (it assumes only independent draws). Too few
    values for the level (n < 6 at 95 %) give no interval."""
    from scipy.stats import binom

    v, n = sorted(values), len(values)
    # P(Bin(n, 1/2) < k) = cdf(k - 1) rises with k: k counts the j with cdf(j) <= (1 - level) / 2 (vectorized:
    # a loop over k took 5 s at n = 10,000)
    k = int(np.count_nonzero(binom.cdf(np.arange(n + 1), n, 0.5) <= (1 - level) / 2)) if n else 0
    return (float(v[k - 1]), float(v[n - k])) if k >= 1 else (None, None)


def sign_test_p(k1, k2):
    """Two-sided exact sign test of ``k1`` outcomes one way against ``k2`` the other (each way equally likely
    under the null): ``min(1, 2 P(Bin(k1 + k2, 1/2) <= min(k1, k2)))``. McNemar's exact test is this test on the
    discordant pairs. No pair (0, 0) gives 1."""
    from scipy.stats import binom

    return float(min(1.0, 2.0 * binom.cdf(min(k1, k2), k1 + k2, 0.5))) if k1 + k2 else 1.0


def bootstrap_interval(stat, columns, level=LEVEL, draws=BOOTSTRAP_DRAWS, seed=BOOTSTRAP_SEED):
    """Percentile bootstrap interval of ``stat`` over samples.

    ``columns`` is a list of arrays with one row per sample, (n,) or (n, k); ``stat(weights, *columns)`` returns
    the statistic of every resample at once, where ``weights`` (B, n) counts how often each sample is drawn into
    resample b (B rows of a multinomial). Resamples whose statistic is NaN (e.g. no success drawn) are left out;
    fewer than 2 samples, or fewer than half the resamples defined, give no interval.
    """
    return bootstrap_intervals(lambda *a: np.asarray(stat(*a))[:, None], columns, 1, level, draws, seed)[0]


def bootstrap_intervals(stat, columns, k, level=LEVEL, draws=BOOTSTRAP_DRAWS, seed=BOOTSTRAP_SEED):
    """:func:`bootstrap_interval` of ``k`` statistics of the same resamples: ``stat`` returns (B, k); a list of
    ``k`` intervals."""
    columns = [np.asarray(c, dtype=np.float64) for c in columns]
    n = len(columns[0])
    if n < 2:
        return [(None, None)] * k
    rng = np.random.default_rng(seed)
    out, per = [], max(1, _CHUNK // n)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanmean of a resample with nothing defined: left out
        for start in range(0, draws, per):
            weights = rng.multinomial(n, np.full(n, 1.0 / n), size=min(per, draws - start)).astype(np.float64)
            out.append(np.asarray(stat(weights, *columns), dtype=np.float64).reshape(len(weights), k))
    values = np.concatenate(out)
    return [_percentiles(v[~np.isnan(v)], level, draws) for v in values.T]


def _percentiles(values, level, draws):
    if len(values) < draws / 2:
        return None, None
    low, high = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def mean_interval(values, level=LEVEL):
    """Bootstrap interval of the mean of ``values``."""
    return bootstrap_interval(lambda w, v: (w @ v) / w.sum(1), [values], level)


def averaged_rate_interval(success, valid, level=LEVEL):
    """Bootstrap interval of the mean over targets of each target's success rate over its valid samples, the
    images resampled together across targets. ``success`` and ``valid`` are (n, T) bool arrays; a resample in
    which a target has no valid sample averages over the other targets, as the summary does."""
    def stat(w, s, v):
        rates = (w @ (s * v)) / (w @ v)  # (B, T); 0 / 0 is NaN: the target is left out of that resample
        return np.nanmean(rates, 1)

    return bootstrap_interval(stat, [success, valid], level) if np.size(success) else (None, None)
