"""``fixed_batch``: every call to a run's forward-only models (a query run's target, a transfer run's targets) has
exactly that many images, so a sample's record does not depend on ``batch_size`` or on its neighbours even where
a model's logits move with the shape of the batch (GPU kernels chosen per shape; here a CPU proxy)."""

import pytest
import torch
from torch import nn

from blackboxbench.errors import ConfigError
from blackboxbench.prep.inference import FixedBatch, fixed_rows
from blackboxbench.prep.models import _digits_model
from blackboxbench.registry import MODEL
from blackboxbench.runner import Session, run_experiment

from test_engine import _exp, _records


class ShapeJitter(nn.Module):
    """Logits that move by a relative ``rel`` with the batch size, differently for each size, and the sizes seen
    (``sizes``): a CPU proxy of per-shape GPU kernels on a batch-invariant float64 model."""

    def __init__(self, model, rel=1e-3):
        super().__init__()
        self.model, self.rel, self.sizes = model, rel, set()

    def forward(self, x):
        m = x.shape[0]
        self.sizes.add(m)
        g = torch.Generator().manual_seed(1000 + m)
        out = self.model(x)
        return out * (1 + (torch.rand(out.shape[1], generator=g, dtype=out.dtype) * 2 - 1) * self.rel)


SEEN = {}  # "target" -> the ShapeJitter last built (the sizes its run forwarded; the runs have fuse: false, so
# that the run forwards this object and not an inference copy of it)


@MODEL.register("test_shape_jitter_digits", dataset="digits")
def shape_jitter_digits(data_root=None):
    SEEN["target"] = ShapeJitter(_digits_model("digits_mlp", True).double())
    return SEEN["target"]


@MODEL.register("test_shape_jitter_digits_cnn", dataset="digits")
def shape_jitter_digits_cnn(data_root=None):
    """A surrogate (gradients, feature hooks) whose logits move by 1e-2 with the batch size."""
    SEEN["surrogate"] = ShapeJitter(_digits_model("digits_cnn", True).double(), rel=1e-2)
    return SEEN["surrogate"]


def _query_runs(tmp_path, attack, norm, eps, sizes, **kw):
    runs = []
    for bs in sizes:
        threat = {"norm": norm, "eps": eps, "max_queries": 600}
        run_dir, _ = run_experiment(_exp(tmp_path / f"{attack}{bs}", attack=attack, model="test_shape_jitter_digits",
                                         threat=threat, batch_size=bs, dataset={"name": "digits", "n": 16},
                                         fuse=False, **kw),
                                    progress=False, session=Session())
        runs.append(_records(run_dir))
    return runs


CASES = [("square_linf", "linf", 0.2), ("nes", "linf", 0.2), ("hsja_l2", "l2", 1.5)]


@pytest.mark.parametrize("attack,norm,eps", CASES, ids=[c[0] for c in CASES])
def test_fixed_batch_records_do_not_depend_on_the_batch_size(tmp_path, attack, norm, eps):
    """Behind logits that move with the batch size, batch_size 1, 7 and 16 give identical records with
    ``fixed_batch: 8``, and the target only ever sees calls of 8 images."""
    runs = _query_runs(tmp_path, attack, norm, eps, (1, 7, 16), fixed_batch=8)
    assert runs[0] == runs[1] == runs[2]
    assert SEEN["target"].sizes == {8}
    assert sum(r["success"] for r in runs[0]) >= 6


def test_without_fixed_batch_the_jitter_shows(tmp_path):
    """The control of the test above: without ``fixed_batch`` the same runs' records differ with the batch size
    (so the proxy moves results, and the wrapper is what makes them equal)."""
    runs = _query_runs(tmp_path, "hsja_l2", "l2", 1.5, (1, 7))
    assert runs[0] != runs[1]


def test_fixed_batch_in_transfer_runs(tmp_path):
    runs = []
    for bs in (1, 7, 16):
        run_dir, _ = run_experiment(_exp(tmp_path / str(bs), attack={"recipe": "mi_fgsm", "hyper": {"iterations": 5}},
                                         surrogates=["digits_cnn"], targets=["test_shape_jitter_digits"],
                                         batch_size=bs, fixed_batch=4, dataset={"name": "digits", "n": 16}, fuse=False,
                                         threat={"norm": "linf", "eps": 0.2}), progress=False, session=Session())
        runs.append(_records(run_dir))
    assert runs[0] == runs[1] == runs[2]
    assert SEEN["target"].sizes == {4}


def test_fixed_batch_pads_and_keeps_gradients():
    """Calls of exactly ``size`` rows, the padding dropped, the rows' answers those of the bare model (a
    row-independent one), gradients through to the input; an empty batch passes through."""
    model = ShapeJitter(nn.Linear(5, 3).double(), rel=0.0)
    fixed = FixedBatch(model, 4)
    x = torch.randn(10, 5, dtype=torch.float64, requires_grad=True)
    out = fixed(x)
    assert out.shape == (10, 3) and model.sizes == {4}
    assert torch.allclose(out, model(x), rtol=0, atol=1e-12)
    out.sum().backward()
    assert torch.allclose(x.grad, model.model.weight.sum(0).expand(10, 5))
    assert fixed(x[:0]).shape == (0, 3)


def test_fixed_rows_are_the_wrappers_calls():
    """The partition the wrapper forwards (and Subspace's per-call hooks follow): runs of ``size`` rows, the last
    padded with its last row; a cache key hashes the wrapped model's weights, not the wrapper's."""
    assert [r.tolist() for r in fixed_rows(10, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 9, 9]]
    assert [r.tolist() for r in fixed_rows(8, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    model = ShapeJitter(nn.Linear(5, 3).double(), rel=0.0)
    x = torch.randn(10, 5, dtype=torch.float64)
    assert torch.equal(FixedBatch(model, 4)(x), torch.cat([model(x[r]) for r in fixed_rows(10, 4)])[:10])
    from blackboxbench.prep.data import Dataset
    from blackboxbench.prep.trained import cache_key
    data = Dataset("toy", torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 3)
    assert cache_key("b", {}, [FixedBatch(model, 4)], data, 0, "cpu") == cache_key("b", {}, [model], data, 0, "cpu")


def test_runs_sharing_a_target_share_its_wrapper():
    session, model = Session(), nn.Linear(2, 2)
    assert session.fixed_batch(model, 8) is session.fixed_batch(model, 8)
    assert session.fixed_batch(model, 8) is not session.fixed_batch(model, 4)


def test_fixed_batch_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="fixed_batch: must be >= 1"):
        _exp(tmp_path, attack="square_linf", model="digits_mlp", threat={"norm": "linf", "eps": 0.2}, fixed_batch=0)
    exp = _exp(tmp_path, attack="square_linf", model="digits_mlp", threat={"norm": "linf", "eps": 0.2},
               fixed_batch=None)
    assert "fixed_batch" not in exp  # null is the default: a run folder's hash does not change


def _transfer_runs(tmp_path, attack, sizes, **kw):
    runs = []
    for bs in sizes:
        run_dir, _ = run_experiment(_exp(tmp_path / f"{bs}", attack=attack, surrogates=["test_shape_jitter_digits_cnn"],
                                         targets=["digits_mlp"], batch_size=bs, dataset={"name": "digits", "n": 16},
                                         fuse=False, threat={"norm": "linf", "eps": 0.1}, **kw),
                                    progress=False, session=Session())
        runs.append(_records(run_dir))
    return runs


TRANSFER = {"mi_fgsm": {"recipe": "mi_fgsm", "hyper": {"iterations": 5}},
            "si_fgsm": {"recipe": "si_fgsm", "hyper": {"iterations": 3}},  # 5 scaled copies per step
            "ila": {"recipe": "ila", "hyper": {"iterations": 4}},  # a feature hook and a reference attack
            "fia": {"recipe": "fia", "hyper": {"iterations": 3}},  # an aggregate gradient over masked copies
            "ghostnet": {"recipe": "ghostnet", "hyper": {"iterations": 3}},
            "mi_di_ti_si": {"recipe": "mi_di_ti_si", "hyper": {"iterations": 2}},
            "admix": {"recipe": "admix", "hyper": {"iterations": 2}},
            "sia": {"recipe": "sia", "hyper": {"iterations": 2}}}  # a fresh ghost per forward and sample


@pytest.mark.parametrize("name", TRANSFER)
def test_fixed_batch_surrogate_calls_in_transfer_runs(tmp_path, name):
    """The transfer worker attacks a batch in parts of ``fixed_batch`` samples: behind a surrogate whose logits
    move with the batch size, batch_size 1, 7 and 16 give identical records (targets' verdicts, distances), and
    the surrogate only sees calls of 4 images or 4 per copy (unwrapped, batch_size 7 would give it calls of 7 and
    2 images)."""
    runs = _transfer_runs(tmp_path, TRANSFER[name], (1, 16, 7), fixed_batch=4)
    assert runs[0] == runs[1] == runs[2]
    seen = SEEN["surrogate"].sizes  # the batch_size 7 run's (the runner's checks before it forward 8 images)
    assert seen and all(size % 4 == 0 for size in seen), seen


def test_without_fixed_batch_the_surrogate_jitter_shows(tmp_path):
    """The control: without ``fixed_batch`` the surrogate's jitter moves some records (distances or verdicts)."""
    runs = _transfer_runs(tmp_path, TRANSFER["mi_fgsm"], (1, 7))
    assert runs[0] != runs[1]


@pytest.mark.parametrize("attack", ["prgf", "subspace"])
def test_fixed_batch_surrogates_of_query_runs(tmp_path, attack):
    """A query run's surrogates are wrapped too (Subspace's per-row dropout hooks run inside each call of the
    wrapper, on that call's rows): records identical at batch_size 1, 7 and 16, surrogate calls of 8 images."""
    runs = _query_runs(tmp_path, attack, "linf", 0.2, (1, 7, 16), fixed_batch=8,
                       surrogates=["test_shape_jitter_digits_cnn"])
    assert runs[0] == runs[1] == runs[2]
    assert SEEN["surrogate"].sizes == {8}
    assert sum(r["success"] for r in runs[0]) >= 6


@pytest.mark.parametrize("attack", ["prgf", "subspace"])
def test_without_fixed_batch_query_surrogate_jitter_shows(tmp_path, attack):
    runs = _query_runs(tmp_path, attack, "linf", 0.2, (1, 7), surrogates=["test_shape_jitter_digits_cnn"])
    assert runs[0] != runs[1]
