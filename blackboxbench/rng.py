"""Per-sample random streams: a sample's random numbers depend only on (seed, sample index) and its own progress.

Every dataset sample owns a counter-based stream (splitmix64, Steele et al. 2014): its key is a hash of the run
seed and the sample index, and its counter is the number of draws the sample took part in so far. Value ``j`` of
a draw is ``mix64(call_key + (j + 1) * GOLDEN)`` with ``call_key = mix64(key ^ mix64(counter + 1))``; a draw that
gives one sample several rows (e.g. HSJA's probes) numbers them ``rank * width + j``. So a sample draws the same
numbers whatever batch it is in, whichever slot it occupies and whoever its neighbours are, and a draw never
advances the counter of a sample that does not take part in it.

Everything is vectorized over rows (int64 tensor arithmetic, wrapping on overflow); on CPU the hash runs in
cache-sized chunks (one pass of ~10 elementwise ops per 64 K values, about the cost of ``torch.rand``).
"""
import contextlib
import functools
import math

import torch

from .errors import BenchError

MASK = (1 << 64) - 1


def _signed(v):
    v &= MASK
    return v - (1 << 64) if v >= 1 << 63 else v


GOLDEN = _signed(0x9E3779B97F4A7C15)
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_SHIFTS = ((30, _M1), (27, _M2), (31, None))
_CHUNK = {"cpu": 1 << 16}  # elements per pass; other devices hash a whole draw at once
_SEED_SALT = _signed(0x6A09E667F3BCC909)  # separates the sample keys from other uses of the same seed


def mix64_(x):
    """The splitmix64 finalizer, in place on an int64 tensor (shifts made logical by masking)."""
    for shift, mult in _SHIFTS:
        x.bitwise_xor_(x.bitwise_right_shift(shift).bitwise_and_((1 << (64 - shift)) - 1))
        if mult is not None:
            x.mul_(mult)
    return x


def mix64_int(v):
    """:func:`mix64_` of one Python integer (the independent reference the tests compare against)."""
    v &= MASK
    for shift, mult in _SHIFTS:
        v ^= v >> shift
        if mult is not None:
            v = (v * mult) & MASK
    return _signed(v)


def sample_keys(seed, index):
    """Stream keys of the samples ``index`` (long tensor) of a run with ``seed``."""
    if not 0 <= int(seed) < 1 << 63:
        raise BenchError(f"seed must be in [0, 2^63), got {seed}")
    base = mix64_int(int(seed) ^ _SEED_SALT)
    return mix64_(index.to(torch.int64) * GOLDEN + base)


def rank_within_group(idx):
    """For each position i, how many earlier positions share ``idx[i]`` (vectorized, stable)."""
    if idx.numel() < 2 or bool((idx[1:] > idx[:-1]).all()):  # ascending, hence distinct: the usual rows
        return torch.zeros_like(idx)
    order = torch.sort(idx, stable=True).indices
    sorted_idx = idx[order]
    first = torch.searchsorted(sorted_idx, sorted_idx, right=False)
    rank = torch.empty_like(idx)
    rank[order] = torch.arange(idx.numel(), device=idx.device) - first
    return rank


@functools.lru_cache(maxsize=64)
def _steps(width, device):
    """``(j + 1) * GOLDEN`` for j < width, (1, width) int64: the offsets of a draw's values from its call key."""
    return torch.arange(1, width + 1, dtype=torch.int64, device=device).mul_(GOLDEN)[None]


@contextlib.contextmanager
def seeded(seed=None):
    """Run a block under torch's global generators forked (the CPU's and every CUDA device's) and, unless ``seed``
    is None, seeded with it: a seeded initialisation or training is the same in every run, and the caller's
    global streams are left as they were. (``fork_rng(devices=[])`` alone keeps only the CPU's, while
    ``torch.manual_seed`` reseeds every CUDA device's as well. Without a CUDA device only the CPU's is seeded:
    torch.manual_seed would queue the CUDA seed for an initialisation that cannot come, formatting the call stack
    each time, 0.4 ms in each call of a detector's loss at every attack step; the library runs on CPU and CUDA.)"""
    devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        if seed is not None and devices:
            torch.manual_seed(seed)
        elif seed is not None:
            torch.default_generator.manual_seed(seed)
        yield


def unit_float64(bits):
    """Uniform [0, 1) float64 values from int64 random patterns (53 bits of each), in ``bits``' shape."""
    return bits.bitwise_right_shift(11).bitwise_and_((1 << 53) - 1).double().mul_(2.0 ** -53)


def bit_planes(bits, k):
    """The first ``k`` single bits of each row of int64 random patterns ``bits`` (m, w), as (m, k) bool (bit j
    of a row is bit j % 64 of its pattern j // 64; needs k <= 64 w)."""
    word, shift = _bit_index(k, bits.device)
    return bits.gather(1, word.expand(len(bits), -1)).bitwise_right_shift_(shift).bitwise_and_(1).bool()


@functools.lru_cache(maxsize=64)
def _bit_index(k, device):
    j = torch.arange(k, device=device)
    return j.div(64, rounding_mode="floor")[None], (j % 64)[None]


class Streams:
    """The random streams of ``n`` samples (dataset indices 0..n-1) of a run with ``seed``, on ``device``."""

    def __init__(self, seed, n, device):
        self.seed, self.device = int(seed), torch.device(device)
        self.key = sample_keys(seed, torch.arange(n, device=self.device))
        self.counter = torch.zeros(n, dtype=torch.int64, device=self.device)

    def view(self, idx):
        """The streams of samples ``idx`` (distinct dataset indices), as rows 0..len(idx)-1."""
        return StreamView(self, torch.as_tensor(idx, dtype=torch.long, device=self.device))


class StreamView:
    """The streams of some samples; blocks use local rows 0..n-1 (see :class:`Streams`).

    Every draw takes ``rows``: the local sample of each output row (default one row per sample). A sample with
    several rows gets consecutive parts of its stream, in the order its rows appear.
    """

    def __init__(self, streams, idx):
        self.streams, self.idx = streams, idx

    @property
    def n(self):
        return self.idx.numel()

    @property
    def device(self):
        return self.streams.device

    def sub(self, rows):
        """The view of local samples ``rows`` (distinct)."""
        return StreamView(self.streams, self.idx[rows.to(self.idx.device)])

    # ---------------------------------------------------------------- raw bits
    def bits(self, width, rows=None):
        """(m, width) int64 of uniformly random 64-bit patterns; one draw for every sample in ``rows``."""
        owner = self.idx if rows is None else self.idx[rows.to(self.idx.device)]
        m = owner.numel()
        out = torch.empty((m, width), dtype=torch.int64, device=self.device)
        if m == 0 or width == 0:
            return out
        s = self.streams
        counter = s.counter[owner].add_(1)  # the draw's number, 1-based
        call_key = mix64_(counter.clone())
        call_key.bitwise_xor_(s.key[owner])
        mix64_(call_key)
        if rows is not None:  # value j of a row is mix64(call_key + (rank * width + 1 + j) * GOLDEN), ranked
            # among the rows of its local sample, so that a padding copy of a sample (the same stream under
            # another local row) draws what the sample draws, as without ``rows``
            call_key.add_(rank_within_group(rows.to(self.idx.device)).mul_(_signed(width * GOLDEN)))
        s.counter.index_put_((owner,), counter)  # repeated owners write the same value
        steps = _steps(width, self.device)
        chunk = max(1, _CHUNK.get(self.device.type, 1 << 62) // width)
        if chunk >= m:  # the usual draw: one pass, no slicing
            return mix64_(torch.add(call_key[:, None], steps, out=out))
        for i in range(0, m, chunk):
            block = out[i:i + chunk]
            torch.add(call_key[i:i + chunk, None], steps, out=block)
            mix64_(block)
        return out

    # ---------------------------------------------------------------- distributions
    def uniform(self, shape, rows=None, dtype=torch.float32):
        """Uniform [0, 1) draws, (m, *shape): 24 random bits per float32 value, 53 per float64 value."""
        k = math.prod(shape)
        if dtype == torch.float64:
            return unit_float64(self.bits(k, rows)).view(-1, *shape)
        b = self.bits((k + 1) // 2, rows)  # two 24-bit values per 64-bit pattern: bits 40-63, then bits 8-31
        words = b.view(torch.int32).view(len(b), -1, 2).flip(-1)  # (high, low) word of each (little-endian)
        u = words.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).to(dtype)
        return u.mul_(2.0 ** -24).view(len(b), -1)[:, :k].reshape(-1, *shape)

    def normal(self, shape, rows=None):
        """Standard normal float32 draws, (m, *shape) (Box-Muller on pairs of 24-bit uniforms)."""
        k = math.prod(shape)
        b = self.bits((k + 1) // 2, rows)
        u1 = (b.bitwise_right_shift(40).bitwise_and_(0xFFFFFF).float() + 1.0) * 2.0 ** -24  # (0, 1]
        u2 = b.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).float() * (2 * math.pi * 2.0 ** -24)
        r = torch.sqrt(-2.0 * torch.log(u1))
        z = torch.empty(b.shape + (2,), device=b.device)  # the pair of each pattern, interleaved
        torch.mul(r, torch.cos(u2), out=z[..., 0])
        torch.mul(r, torch.sin(u2), out=z[..., 1])
        return z.flatten(1)[:, :k].reshape(-1, *shape)

    def signs(self, shape, rows=None):
        """Uniform {-1, +1} float32 draws, (m, *shape)."""
        return torch.where(self.uniform(shape, rows) < 0.5, -1.0, 1.0)

    def randint_below(self, high, rows=None):
        """One uniform integer in ``[0, high[r])`` per row (``high`` (m,) long, each in [1, 2^53)).

        ``u * high`` stays below ``high`` for every float64 ``u`` < 1 (the largest, 1 - 2^-53, times an integer
        rounds to at most ``high`` - ulp), so the floor never reaches ``high``.
        """
        u = self.uniform((), rows, torch.float64)
        return (u * high.to(u.device, torch.float64)).long()  # ``high`` may live on another device

    def permutations(self, d, key=None, rows=None):
        """A random permutation of ``range(d)`` per row, (m, d) long (argsort of uniforms). With ``key`` (d,)
        (integer-valued), coordinates are sorted by ``key`` first and shuffled only among equal keys."""
        u = self.uniform((d,), rows, torch.float64)
        if key is not None:
            u = u + key.to(u.dtype)[None]
        return u.argsort(dim=1)


def run_stream(seed, device, salt):
    """One stream for run-level randomness (e.g. surrogate refinement), separate from every sample's: the stream
    of a sample index no dataset has (2^62 + ``salt``)."""
    s = Streams.__new__(Streams)
    s.device = torch.device(device)
    s.key = sample_keys(seed, torch.tensor([(1 << 62) + int(salt)], device=s.device))
    s.counter = torch.zeros(1, dtype=torch.int64, device=s.device)
    return s.view(torch.zeros(1, dtype=torch.long))


class RowDraws:
    """Where a random module inside a model (GhostNet's eroded blocks) takes its numbers: the view ``rng`` of the
    samples being attacked, which a worker binds for the duration of their attack (:func:`drawing_from`), else the
    run's stream (one sample). A forward of ``m`` rows holds ``m / n`` stacked copies of the ``n`` samples
    (copy-major) and draws once, one row per copy, so that a sample's draws, like every other draw of its
    attack, depend neither on its batch nor on a padding copy beside it."""

    def __init__(self, rng):
        self.default = self.rng = rng

    def uniform(self, shape, m, dtype=torch.float32):
        """(m, *shape) uniform [0, 1) values for a forward of ``m`` rows."""
        n = self.rng.n
        if m % n:
            raise BenchError(f"a random module of the model was forwarded {m} rows for {n} samples; it draws "
                             "per sample, so a forward must hold whole copies of the batch")
        return self.rng.uniform(shape, torch.arange(n, device=self.rng.device).repeat(m // n), dtype)


@contextlib.contextmanager
def drawing_from(model, rng):
    """Bind every :class:`RowDraws` inside ``model`` (modules with a ``draws`` attribute; None: no model) to the
    view ``rng`` for the duration of the block; they return to their earlier binding afterwards, even on an
    error."""
    found = [] if model is None else (getattr(m, "draws", None) for m in model.modules())
    before = {id(d): (d, d.rng) for d in found if isinstance(d, RowDraws)}
    for d, _ in before.values():
        d.rng = rng
    try:
        yield
    finally:
        for d, old in before.values():
            d.rng = old
