"""The statistics the benchmark scripts report: the sign-test interval of a median (benchmarks/fidelity_transfer.py,
``--part timing``), checked against scipy's binomial distribution."""
import importlib.util
from pathlib import Path

import pytest
from scipy.stats import binom

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "fidelity_transfer.py"


def _median_ci():
    spec = importlib.util.spec_from_file_location("fidelity_transfer", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.median_ci


@pytest.mark.parametrize("n", [6, 7, 8, 12, 16, 20, 31])
def test_median_interval_is_the_widest_sign_test_interval_at_95(n):
    median_ci = _median_ci()
    values = [float(v) for v in range(n)][::-1]  # unsorted on purpose
    med, lo, hi = median_ci(values)
    assert med == (n - 1) / 2
    k = int(lo) + 1  # the interval is (x_(k), x_(n+1-k)), 1-based
    assert hi == n - k
    # coverage of (x_(k), x_(n+1-k)) is 1 - 2 P(Bin(n, 1/2) <= k - 1): at least 95 %, and k + 1 would drop below
    assert 1 - 2 * binom.cdf(k - 1, n, 0.5) >= 0.95
    assert 1 - 2 * binom.cdf(k, n, 0.5) < 0.95


def test_median_interval_needs_six_values():
    median_ci = _median_ci()
    assert median_ci([1.0, 3.0, 2.0, 5.0, 4.0]) == (3.0, None, None)
    assert median_ci([1.0, 2.0]) == (1.5, None, None)
