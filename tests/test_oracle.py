import pytest
import torch
from torch import nn

from blackboxbench.errors import BenchError
from blackboxbench.oracle import Oracle, rank_within_group


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.seen = 0

    def forward(self, x):
        self.seen += x.shape[0]
        return self.lin(x.flatten(1))


def test_rank_within_group():
    idx = torch.tensor([2, 0, 2, 2, 1, 0])
    assert rank_within_group(idx).tolist() == [0, 0, 1, 2, 0, 1]


def test_budget_is_hard_and_counts_every_image():
    model = Counting()
    oracle = Oracle(model, n=3, max_queries=4, num_classes=3, feedback="score", input_shape=(1, 2, 2))
    x = torch.rand(9, 1, 2, 2)
    idx = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 2])  # sample 1 asks for 5 > 4
    ans, ok = oracle(x, idx)
    assert ok.tolist() == [True] * 7 + [False, True]
    assert oracle.counts.tolist() == [3, 4, 1] and model.seen == 8
    assert torch.isnan(ans[7]).all() and not torch.isnan(ans[:7]).any()
    ans, ok = oracle(x[:3], torch.tensor([0, 0, 1]))  # sample 0 has one left, sample 1 none
    assert ok.tolist() == [True, False, False] and oracle.counts.tolist() == [4, 4, 1]
    assert (oracle.counts <= 4).all() and model.seen == 9


def test_views_map_local_indices():
    oracle = Oracle(Counting(), n=4, max_queries=10, num_classes=3, feedback="label")
    view = oracle.view(torch.tensor([1, 3])).view(torch.tensor([1]))
    ans, ok = view(torch.rand(2, 1, 2, 2), torch.tensor([0, 0]))
    assert oracle.counts.tolist() == [0, 0, 0, 2] and ans.dtype == torch.long and ok.all()
    assert view.remaining().tolist() == [8] and view.spent().tolist() == [False]
    view(torch.rand(8, 1, 2, 2), torch.zeros(8, dtype=torch.long))
    outer = oracle.view(torch.tensor([1, 3]))
    assert outer.remaining().tolist() == [10, 0] and outer.spent().tolist() == [False, True]


def test_no_gradient_and_only_scores_or_labels():
    model = Counting()
    oracle = Oracle(model, n=2, max_queries=5, num_classes=3, feedback="score")
    x = torch.rand(2, 1, 2, 2, requires_grad=True)
    ans, _ = oracle(x)
    assert not ans.requires_grad and ans.grad_fn is None
    assert torch.allclose(ans.exp().sum(1), torch.ones(2))  # log-probabilities
    with pytest.raises(RuntimeError):
        ans.sum().backward()
    assert model.lin.weight.grad is None and x.grad is None
    labels, _ = Oracle(model, n=2, max_queries=5, num_classes=3, feedback="label")(x)
    assert labels.dtype == torch.long and labels.dim() == 1


def test_bad_shapes_are_one_line_errors():
    oracle = Oracle(Counting(), n=2, max_queries=5, num_classes=3, input_shape=(1, 2, 2))
    with pytest.raises(BenchError, match="shape"):
        oracle(torch.rand(2, 1, 3, 3))
    with pytest.raises(BenchError, match="len\\(idx\\)"):
        oracle(torch.rand(3, 1, 2, 2), torch.tensor([0, 1]))
    with pytest.raises(BenchError):
        Oracle(Counting(), n=2, max_queries=5, num_classes=3, feedback="logits")


def test_confirm_reuses_the_last_answer_for_the_same_image_only():
    model = Counting()
    oracle = Oracle(model, n=3, max_queries=10, num_classes=3, feedback="score")
    x = torch.rand(3, 1, 2, 2)
    first, _ = oracle(x)
    first[:] = 0.0  # a caller scribbling on its answer cannot change what the oracle remembers
    again, ok = oracle.confirm(x.clone())
    assert model.seen == 3 and oracle.counts.tolist() == [1, 1, 1] and ok.all()  # no forward, no count
    with torch.no_grad():
        assert torch.allclose(again, torch.log_softmax(model.lin(x.flatten(1)), 1))
    changed = x.clone()
    changed[1, 0, 0, 0] += 1 / 255
    answer, ok = oracle.confirm(changed)  # only sample 1 differs: only it is forwarded and counted
    assert model.seen == 4 and oracle.counts.tolist() == [1, 2, 1] and ok.all()
    assert torch.allclose(answer[[0, 2]], again[[0, 2]])
    oracle(x[:2], torch.tensor([0, 0]))  # a call with repeated samples is not remembered
    oracle.confirm(x[:1], torch.tensor([0]))
    assert model.seen == 7 and oracle.counts.tolist() == [4, 2, 1]


def test_views_need_distinct_samples():
    oracle = Oracle(Counting(), n=4, max_queries=10, num_classes=3)
    with pytest.raises(BenchError, match="distinct"):
        oracle.view(torch.tensor([1, 1]))


def test_confirm_does_not_reuse_an_answer_for_images_the_caller_changed_in_place():
    """The oracle remembers a private copy of the images it answered: an attack that updates its query tensor in
    place after the call (``x.add_(...)``) asks confirm() about new images, which must be forwarded and counted,
    never given the answer of the images that tensor held before."""
    model = Counting()
    oracle = Oracle(model, n=2, max_queries=10, num_classes=3, feedback="score")
    x = torch.rand(2, 1, 2, 2) * 0.5
    oracle(x)
    x[1].add_(0.25)  # the caller's tensor now holds another image for sample 1
    answer, ok = oracle.confirm(x)
    assert ok.all() and model.seen == 3 and oracle.counts.tolist() == [1, 2]
    with torch.no_grad():
        assert torch.allclose(answer[1], torch.log_softmax(model.lin(x[1].flatten()), 0))


def test_non_finite_logits_are_refused_never_read_as_an_answer():
    """A target that returns NaN or inf logits for a query (here: for images brighter than 0.5) is a one-line
    error of the oracle's own, in both feedback modes: a NaN row would otherwise read as a refused score row, or as
    class 0 through argmax, and the query is not answered."""
    class Blows(nn.Module):
        def forward(self, x):
            out = torch.zeros(x.shape[0], 3)
            out[x.flatten(1).mean(1) > 0.5, 1] = float("nan")
            return out

    for feedback in ("score", "label"):
        oracle = Oracle(Blows(), n=2, max_queries=5, num_classes=3, feedback=feedback)
        oracle(torch.zeros(2, 1, 2, 2))  # finite logits: answered
        with pytest.raises(BenchError, match="non-finite logits"):
            oracle(torch.stack([torch.zeros(1, 2, 2), torch.ones(1, 2, 2)]))
