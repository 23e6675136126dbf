"""Per-sample counter-based random streams: the hash against an independent pure-Python splitmix64, the
distributions against their moments, and the property the engine relies on: a sample draws the same numbers
whatever batch it is in and whoever else draws."""
import math

import pytest
import torch

from blackboxbench.errors import BenchError
from blackboxbench.rng import GOLDEN, MASK, Streams, mix64_, mix64_int, rank_within_group, run_stream, sample_keys


def splitmix64_reference(v):
    """splitmix64's finalizer (Steele, Lea, Flood 2014), unsigned 64-bit arithmetic in Python integers."""
    z = v & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_mix64_matches_the_reference():
    values = [0, 1, 2, 12345, 2 ** 40 + 7, 2 ** 63 - 1, -1, -(2 ** 63), GOLDEN, 0x1234567890ABCDEF]
    out = mix64_(torch.tensor(values, dtype=torch.int64))
    for v, o in zip(values, out.tolist()):
        assert o & MASK == splitmix64_reference(v) and o == mix64_int(v)


def test_bits_are_the_documented_formula():
    s = Streams(7, 4, "cpu")
    key, counter = s.key[2].item(), 0
    bits = s.view(torch.tensor([2])).bits(5)[0].tolist()
    call_key = mix64_int(mix64_int(counter + 1) ^ key)
    assert bits == [mix64_int(call_key + (j + 1) * GOLDEN) for j in range(5)]
    assert s.counter.tolist() == [0, 0, 1, 0]


def test_a_sample_draws_the_same_in_any_batch():
    a = Streams(3, 10, "cpu")
    b = Streams(3, 10, "cpu")
    whole = a.view(torch.arange(10)).normal((3, 4))
    alone = torch.cat([b.view(torch.tensor([i])).normal((3, 4)) for i in (9, 0, 4, 1, 2, 3, 5, 6, 7, 8)])
    order = torch.tensor([9, 0, 4, 1, 2, 3, 5, 6, 7, 8])
    assert torch.equal(whole[order], alone)
    # a draw for a subset advances only that subset
    sub = a.view(torch.arange(10)).sub(torch.tensor([1, 5]))
    sub.uniform((2,))
    assert a.counter.tolist() == [1, 2, 1, 1, 1, 2, 1, 1, 1, 1]


def test_repeated_rows_take_consecutive_parts_of_the_stream():
    a, b = Streams(0, 3, "cpu"), Streams(0, 3, "cpu")
    rows = torch.tensor([0, 2, 0, 0, 2])
    mixed = a.view(torch.arange(3)).uniform((6,), rows=rows)
    only0 = b.view(torch.tensor([0])).uniform((6,), rows=torch.tensor([0, 0, 0]))
    only2 = b.view(torch.tensor([2])).uniform((6,), rows=torch.tensor([0, 0]))
    assert torch.equal(mixed[[0, 2, 3]], only0) and torch.equal(mixed[[1, 4]], only2)
    assert a.counter.tolist() == [1, 0, 1]
    assert rank_within_group(rows).tolist() == [0, 0, 1, 2, 1]


def test_a_padding_copy_draws_what_its_sample_draws():
    """A view whose last sample is repeated (a ``fixed_batch`` part padded with a copy of its last sample): with
    rows for K stacked copies, every row of the original draws what it draws without the padding, and the
    padding copy the same values."""
    a, b = Streams(4, 5, "cpu"), Streams(4, 5, "cpu")
    k = 3
    padded = a.view(torch.tensor([3, 4, 4])).uniform((2,), rows=torch.arange(3).repeat(k)).view(k, 3, 2)
    plain = b.view(torch.tensor([3, 4])).uniform((2,), rows=torch.arange(2).repeat(k)).view(k, 2, 2)
    assert torch.equal(padded[:, :2], plain) and torch.equal(padded[:, 2], padded[:, 1])
    assert torch.equal(a.counter, b.counter)


def test_seeds_and_samples_give_different_streams():
    keys = torch.cat([sample_keys(s, torch.arange(1000)) for s in range(3)])
    assert keys.unique().numel() == 3000
    assert not torch.equal(Streams(0, 2, "cpu").view(torch.arange(2)).uniform((8,))[0],
                           Streams(0, 2, "cpu").view(torch.arange(2)).uniform((8,))[1])
    assert not torch.equal(run_stream(0, "cpu", 1).uniform((8,)), Streams(0, 1, "cpu").view(torch.tensor([0]))
                           .uniform((8,)))
    with pytest.raises(BenchError):
        sample_keys(2 ** 64, torch.arange(2))


def test_distributions():
    rng = Streams(11, 64, "cpu").view(torch.arange(64))
    u = rng.uniform((5000,))
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    # 100 equal bins: a chi-square far below its 1e-6 tail
    counts = torch.bincount((u.flatten() * 100).long(), minlength=100).double()
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum()
    assert chi2 < 190
    d = rng.uniform((4000,), dtype=torch.float64)
    assert d.dtype == torch.float64 and 0 <= d.min() and d.max() < 1 and abs(d.mean() - 0.5) < 0.005
    z = rng.normal((5000,))
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs((z.abs() < 1.959964).float().mean() - 0.95) < 0.005
    s = rng.signs((1000,))
    assert set(s.unique().tolist()) == {-1.0, 1.0} and abs(s.mean()) < 0.02
    # neighbouring samples and consecutive draws are uncorrelated
    a, b = rng.normal((2000,)), rng.normal((2000,))
    assert abs((a[:-1] * a[1:]).mean()) < 0.01 and abs((a * b).mean()) < 0.01


def test_integers_and_permutations():
    rng = Streams(5, 8, "cpu").view(torch.arange(8))
    high = torch.tensor([1, 2, 3, 7, 31, 32, 1000, 2 ** 40 + 3])
    u_max = torch.tensor(1.0, dtype=torch.float64).nextafter(torch.tensor(0.0, dtype=torch.float64))
    assert ((u_max * high).long() == high - 1).all()  # the largest float64 below 1 never rounds up to high
    draws = torch.stack([rng.randint_below(high) for _ in range(300)])
    assert (draws >= 0).all() and (draws < high).all()
    assert (draws[:, 2].bincount(minlength=3) > 60).all()
    perm = rng.permutations(50)
    assert torch.equal(perm.sort(1).values, torch.arange(50).expand(8, -1))
    key = torch.arange(50) // 10  # sorted by key first, shuffled within equal keys
    perm = rng.permutations(50, key)
    assert torch.equal(key[perm], key.expand(8, -1)) and not torch.equal(perm[0], torch.arange(50))
    assert math.isclose(float(rng.uniform(()).shape[0]), 8)


def test_bit_planes_and_unit_float64_are_the_documented_formulas():
    from blackboxbench.rng import bit_planes, unit_float64

    b = Streams(3, 4, "cpu").view(torch.arange(4)).bits(2)
    planes = bit_planes(b, 100)
    for r in range(4):
        words = [v & MASK for v in b[r].tolist()]
        assert planes[r].tolist() == [bool(words[j // 64] >> (j % 64) & 1) for j in range(100)]
        assert unit_float64(b[r:r + 1]).tolist()[0] == [(w >> 11) * 2.0 ** -53 for w in words]
    assert torch.equal(unit_float64(b), Streams(3, 4, "cpu").view(torch.arange(4)).uniform((2,), dtype=torch.float64))


def test_seeded_forks_the_global_streams():
    """``seeded(s)`` draws as after ``torch.manual_seed(s)`` and leaves the caller's global stream where it was
    (on CUDA machines every device's stream is forked too)."""
    from blackboxbench.rng import seeded

    torch.manual_seed(5)
    expected_next = torch.rand(3)
    torch.manual_seed(5)
    with seeded(7):
        inside = torch.rand(3)
    with seeded():
        torch.rand(10)  # an unseeded block's draws do not advance the caller's stream either
    assert torch.equal(torch.rand(3), expected_next)
    torch.manual_seed(7)
    assert torch.equal(inside, torch.rand(3))


def test_a_sub_view_draws_from_its_own_samples_streams():
    """``StreamView.sub`` of local rows maps them to the view's dataset samples: in a view of samples (7, 2, 5),
    local rows (2, 0) are samples 5 and 7, and draw what those samples draw alone; only their counters move (a
    sub-view that read the local rows as dataset indices would draw samples 2 and 0's numbers)."""
    a, b = Streams(11, 8, "cpu"), Streams(11, 8, "cpu")
    sub = a.view(torch.tensor([7, 2, 5])).sub(torch.tensor([2, 0]))
    got = sub.uniform((4,))
    want = torch.cat([b.view(torch.tensor([5])).uniform((4,)), b.view(torch.tensor([7])).uniform((4,))])
    assert torch.equal(got, want)
    assert a.counter.tolist() == [0, 0, 0, 0, 0, 1, 0, 1]


def test_row_draws_give_each_stacked_copy_row_its_own_samples_stream():
    """A random module's forward of m = K n rows holds K copies of the n samples, copy-major (row r is sample
    r % n): each row draws from its own sample's stream, copy j taking that sample's j-th row of the draw, so the
    first copy draws what a forward of one copy draws, and a sample's rows do not depend on the other samples."""
    from blackboxbench.rng import RowDraws

    a, b = Streams(9, 6, "cpu"), Streams(9, 6, "cpu")
    stacked = RowDraws(a.view(torch.tensor([4, 1, 3]))).uniform((5,), 6)  # 2 copies of samples 4, 1, 3
    for r, sample in enumerate([4, 1, 3]):
        alone = Streams(9, 6, "cpu").view(torch.tensor([sample])).uniform((5,), rows=torch.zeros(2, dtype=torch.long))
        assert torch.equal(stacked[r], alone[0]) and torch.equal(stacked[3 + r], alone[1]), sample
    assert torch.equal(stacked[:3], RowDraws(b.view(torch.tensor([4, 1, 3]))).uniform((5,), 3))
