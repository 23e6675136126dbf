import pytest
import torch

from blackboxbench.threat import (Problem, dist, grid_levels, margin_loss, project, quantize, quantize_l2,
                                  quantize_outward)


@pytest.mark.parametrize("norm,eps", [("linf", 0.03), ("linf", 8 / 255), ("l2", 0.5), ("l2", 1.0)])
def test_project_then_quantize_stays_in_ball_and_grid(norm, eps):
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 8, 8), generator=g).float() / 255
    x_adv = x + torch.randn(x.shape, generator=g) * 0.2
    p = project(x_adv, x, eps, norm)
    assert (dist(p, x, norm) <= eps + 1e-6).all() and p.min() >= 0 and p.max() <= 1
    q = quantize(p, x)
    assert torch.equal(q * 255, torch.round(q * 255))
    assert (dist(q, x, norm) <= dist(p, x, norm) + 1e-5).all()  # rounding towards x never grows the norm (up to float noise)
    assert q.min() >= 0 and q.max() <= 1
    assert ((q - x).abs() <= (p - x).abs() + 4e-6).all()


def test_project_matches_reference():
    x = torch.full((1, 1, 2, 2), 0.5)
    assert torch.allclose(project(x + torch.tensor([0.1, -0.2, 0.01, 0.9]).view(1, 1, 2, 2), x, 0.05, "linf"),
                          torch.tensor([0.55, 0.45, 0.51, 0.55]).view(1, 1, 2, 2))
    d = torch.tensor([0.3, 0.4, 0.0, 0.0]).view(1, 1, 2, 2)  # L2 norm 0.5 -> scaled to 0.25
    assert torch.allclose(project(x + d, x, 0.25, "l2"), x + d / 2)


@pytest.mark.parametrize("norm,eps", [("linf", 0.03), ("l2", 0.5)])
def test_project_keeps_points_inside_the_ball_bit_for_bit(norm, eps):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (16, 3, 8, 8), generator=g).float() / 255
    inside = quantize(project(x + torch.randn(x.shape, generator=g) * 0.1, x, eps, norm), x)
    assert torch.equal(project(inside, x, eps, norm), inside)


def test_quantize_outward_grows_every_perturbation_within_the_grid_ball():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, 256, (32, 3, 8, 8), generator=g).float() / 255
    eps = 0.03  # 7.65 levels: the grid ball has radius 7/255
    assert grid_levels(eps) == 7 and grid_levels(8 / 255) == 8 and grid_levels(1.0) == 255
    p = project(x + (torch.rand(x.shape, generator=g) - 0.5) * 0.08, x, eps, "linf")
    q = quantize_outward(p, x, eps)
    assert torch.equal(q * 255, torch.round(q * 255)) and q.min() >= 0 and q.max() <= 1
    assert (dist(q, x, "linf") <= 7 / 255 + 1e-6).all()
    d, e = (p - x) * 255, (q - x) * 255
    assert ((d * e) >= 0).all()  # no coordinate changes sign
    grid = torch.round(x * 255)
    reach = torch.minimum(torch.full_like(d, 7.0), torch.where(d >= 0, 255 - grid, grid))  # levels available
    assert torch.allclose(e.abs(), torch.minimum(torch.ceil(d.abs() - 1e-3), reach))
    assert torch.equal(quantize_outward(q, x, eps), q)


def test_quantize_keeps_grid_points_and_rounds_towards_clean():
    x = torch.tensor([[[[10 / 255, 200 / 255]]]])
    assert torch.equal(quantize(x, x), x)
    x_adv = x + torch.tensor([[[[7.6 / 255, -7.6 / 255]]]])
    assert torch.allclose(quantize(x_adv, x) * 255, torch.tensor([[[[17.0, 193.0]]]]))


def test_margin_loss_reference():
    s = torch.tensor([[3.0, 1.0, 2.0], [0.0, 5.0, 1.0]])
    y = torch.tensor([0, 0])
    assert torch.allclose(margin_loss(s, y), torch.tensor([1.0, -5.0]))
    t = torch.tensor([2, 2])
    assert torch.allclose(margin_loss(s, y, t), torch.tensor([1.0, 4.0]))


def test_problem_success_from_labels_and_scores():
    p = Problem(x=torch.zeros(3, 1, 2, 2), y=torch.tensor([0, 1, 2]), eps=0.1, norm="linf")
    assert p.is_adv_label(torch.tensor([1, 1, -1])).tolist() == [True, False, False]
    scores = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [float("nan")] * 3])
    assert p.is_adv(scores).tolist() == [True, False, False]
    pt = Problem(x=torch.zeros(2, 1, 2, 2), y=torch.tensor([0, 0]), eps=0.1, norm="linf",
                 target=torch.tensor([2, 1]))
    assert pt.is_adv_label(torch.tensor([2, 2])).tolist() == [True, False]
    assert pt.sub(torch.tensor([1])).target.tolist() == [1]


@pytest.mark.parametrize("eps", [0.05, 0.5, 1.0, 3.0])
def test_quantize_l2_rounds_to_nearest_while_the_ball_has_room(eps):
    """L2 outputs: on the grid, in [0, 1], inside the ball; each coordinate at its nearest level or at the level
    towards the clean image; the nearest image itself whenever it is inside the ball; closer to the float image
    and longer than rounding every coordinate towards the clean image (which zeroes sub-level perturbations)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 256, (64, 3, 8, 8), generator=g).float() / 255
    p = project(x + torch.randn(x.shape, generator=g) * eps / 8, x, eps, "l2")
    q, toward = quantize_l2(p, x, eps), quantize(p, x)
    assert torch.equal(q * 255, torch.round(q * 255)) and q.min() >= 0 and q.max() <= 1
    assert (dist(q, x, "l2") <= eps).all()
    near = torch.round(p * 255) / 255
    assert ((q == near) | (q == toward)).all()
    fits = dist(near, x, "l2") <= eps * (1 - 1e-6)
    assert fits.any() and torch.equal(q[fits], near[fits])
    assert (dist(q, p, "l2") <= dist(toward, p, "l2") + 1e-6).all()
    assert dist(q, x, "l2").mean() > dist(toward, x, "l2").mean()
    assert torch.equal(quantize_l2(p[5:9], x[5:9], eps), q[5:9])  # rows are rounded independently


def test_quantize_l2_keeps_the_cheapest_outward_roundings_when_the_ball_is_full():
    """Four coordinates 0.6 levels out and one 2.6 levels out of a clean grey image, eps = sqrt(10) levels:
    towards clean gives (0, 0, 0, 0, 2), 4 levels^2; the room left (6) takes the four cheap roundings (1 each)
    and not the dear one (2 x 2 + 1 = 5 more would make 13 > 10)."""
    x = torch.full((1, 1, 1, 5), 100 / 255)
    p = x + torch.tensor([0.6, 0.6, 0.6, 0.6, 2.6]).view(1, 1, 1, 5) / 255
    q = quantize_l2(p, x, 10 ** 0.5 / 255)
    assert torch.allclose((q - x) * 255, torch.tensor([1.0, 1.0, 1.0, 1.0, 2.0]).view(1, 1, 1, 5), atol=1e-4)
    assert Problem(x, torch.zeros(1, dtype=torch.long), 10 ** 0.5 / 255, "l2").quantize(p).equal(q)
    assert Problem(x, torch.zeros(1, dtype=torch.long), 3 / 255, "linf").quantize(p).equal(quantize(p, x))


def test_flat_norm_counts_negative_perturbations():
    """Per-sample Linf and L2 norms against a plain reference, on perturbations whose largest entry is negative: a
    Linf norm that forgot the absolute value would read the largest *signed* entry and under-report a record's
    ``linf`` and the output guard's distance."""
    from blackboxbench.threat import flat_norm

    v = torch.tensor([[-0.5, 0.1, 0.0, 0.2], [0.05, -0.04, 0.0, 0.0], [-0.3, -0.1, -0.2, -0.6]]).view(3, 1, 2, 2)
    ref_linf = [max(abs(a) for a in row) for row in v.flatten(1).tolist()]
    ref_l2 = [sum(a * a for a in row) ** 0.5 for row in v.flatten(1).tolist()]
    assert flat_norm(v, "linf").tolist() == pytest.approx(ref_linf, abs=1e-7)
    assert flat_norm(v, "l2").tolist() == pytest.approx(ref_l2, abs=1e-7)
    x = torch.full((3, 1, 2, 2), 0.7)
    assert dist(x + v, x, "linf").tolist() == pytest.approx(ref_linf, abs=1e-6)


def test_grid_levels_tolerates_eps_written_with_float_noise():
    """A radius of k levels written as a rounded decimal (0.0313725490 for 8/255) or built by float arithmetic
    (k times 1/255) is k levels, not k - 1: the tolerance in :func:`grid_levels` is what the docstring promises."""
    for k in range(256):
        assert grid_levels(k / 255) == k
        assert grid_levels(float(f"{k / 255:.10f}")) == k, k
        assert grid_levels(sum([1 / 255] * k)) == k, k
    assert grid_levels(7.5 / 255) == 7 and grid_levels(0.03) == 7
