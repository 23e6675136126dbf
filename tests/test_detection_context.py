"""CAA's context tables and sequential plans (blackboxbench/detection/context.py) against independent references:
the tables against a per-pair loop written as the authors' notebook counts (dicts of lists, then means), the
plans and helper boxes against the rules of the authors' get_sequential_attack_plan / generate_box checked by
hand, and the asset's config errors."""
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from blackboxbench.config import ConfigError, validate_experiment
from blackboxbench.detection.attacks import caa
from blackboxbench.detection.context import (HELPER_P, U_STEP, ContextTables, context_tables, detection_context,
                                             helper_box, helper_distribution, pick, sequential_plans)
from blackboxbench.errors import BenchError
from blackboxbench.runner import run_experiment
from blackboxbench.registry import FAMILY


def reference_tables(targets, sizes, k):
    """The authors' notebook's counting, written out pair by pair."""
    co = [[0] * k for _ in range(k)]
    dist, size, single = defaultdict(list), defaultdict(list), defaultdict(list)
    for t, (h, w) in zip(targets, sizes):
        diag = math.sqrt(w * w + h * h)
        objs = [(int(lab), [float(v) for v in box]) for box, lab in zip(t["boxes"], t["labels"])]
        for lab, (x0, y0, x1, y1) in objs:
            single[lab].append(((y1 - y0) / diag, (x1 - x0) / diag))
        for i in range(len(objs)):
            for j in range(i + 1, len(objs)):
                (o1, b1), (o2, b2) = objs[i], objs[j]
                d = math.dist(((b1[0] + b1[2]) / 2, (b1[1] + b1[3]) / 2), ((b2[0] + b2[2]) / 2, (b2[1] + b2[3]) / 2))
                s12 = ((b2[3] - b2[1]) / diag, (b2[2] - b2[0]) / diag)
                s21 = ((b1[3] - b1[1]) / diag, (b1[2] - b1[0]) / diag)
                co[o1][o2] += 1
                dist[o1, o2].append(d / diag)
                size[o1, o2].append(s12)
                if o1 != o2:
                    co[o2][o1] += 1
                    dist[o2, o1].append(d / diag)
                    size[o2, o1].append(s21)
    return co, dist, size, single


def _random_targets(n, k, gen):
    out = []
    for _ in range(n):
        m = int(torch.randint(0, 6, (), generator=gen))
        xy = torch.rand(m, 2, generator=gen) * 50
        wh = torch.rand(m, 2, generator=gen) * 30 + 2
        out.append({"boxes": torch.cat([xy, xy + wh], 1), "labels": torch.randint(0, k, (m,), generator=gen)})
    return out


def test_tables_match_the_pairwise_reference():
    gen = torch.Generator().manual_seed(3)
    k = 4
    targets = _random_targets(40, k, gen)
    sizes = [(64, 80)] * 20 + [(100, 60)] * 20
    t = context_tables(targets, sizes, k)
    co, dist, size, single = reference_tables(targets, sizes, k)
    assert t.count.tolist() == co
    for i in range(k):
        for j in range(k):
            if co[i][j]:
                assert float(t.dist[i, j]) == pytest.approx(sum(dist[i, j]) / len(dist[i, j]), abs=1e-12)
                ref = torch.tensor(size[i, j], dtype=torch.float64).mean(0)
                assert torch.allclose(t.size[i, j], ref, atol=1e-12)
            else:
                assert float(t.dist[i, j]) == 0 and not t.size[i, j].any()
        if single[i]:
            assert torch.allclose(t.single[i], torch.tensor(single[i], dtype=torch.float64).mean(0), atol=1e-12)
        assert int(t.single_n[i]) == len(single[i])


def test_tables_by_hand():
    """Two squares of class 0 and a class-1 box on a 30 x 40 image (diagonal 50): a same-class pair is counted
    once on the diagonal, a mixed pair in both orders."""
    boxes = torch.tensor([[0., 0, 10, 10], [30, 0, 40, 10], [0, 20, 10, 30]])
    t = context_tables([{"boxes": boxes, "labels": torch.tensor([0, 0, 1])}], [(30, 40)], 2)
    assert t.count.tolist() == [[1, 2], [2, 0]]
    assert float(t.dist[0, 0]) == pytest.approx(30 / 50)
    assert float(t.dist[0, 1]) == pytest.approx((20 + math.hypot(30, 20)) / 2 / 50)
    assert t.size[0, 1].tolist() == pytest.approx([10 / 50, 10 / 50])
    assert t.single_n.tolist() == [2, 1]


def _tables(count, dist=0.3, size=(0.1, 0.15)):
    k = len(count)
    count = torch.tensor(count, dtype=torch.float64)
    return ContextTables(count, torch.full((k, k), dist, dtype=torch.float64),
                         torch.tensor(size, dtype=torch.float64).expand(k, k, 2).clone(),
                         torch.tensor(size, dtype=torch.float64).expand(k, 2).clone(),
                         torch.ones(k, dtype=torch.float64))


def test_helper_distribution_drops_rare_classes():
    t = _tables([[10, 1, 89, 0], [1, 0, 0, 0], [0, 0, 0, 0], [5, 5, 5, 5]])
    p = helper_distribution(t, 0)
    assert p.tolist() == pytest.approx([10 / 99, 0, 89 / 99, 0])  # 1 % and 0 % dropped (threshold 5 %)
    assert p[1] == 0 and HELPER_P == 0.05
    assert helper_distribution(t, 2).tolist() == pytest.approx([0.25] * 4)  # an empty row: every class alike
    assert helper_distribution(t, 3).tolist() == pytest.approx([0.25] * 4)


@pytest.mark.parametrize("u,expect", [(0.0, 0), (0.099, 0), (0.101, 2), (0.9999999, 2)])
def test_pick_is_the_inverse_cdf_over_nonzero_classes(u, expect):
    assert pick(torch.tensor([0.1, 0.0, 0.9, 0.0], dtype=torch.float64), u) == expect


def test_helper_box_at_the_table_distance_and_size():
    """A pair seen together: the box has the table's size (h, w in units of the diagonal) and its centre lies
    at the table's distance from the victim's centre (int truncation as the authors: within 1.5 px), in a
    quadrant between two free directions; the same uniforms give the same box."""
    h, w = 120, 160
    diag = math.hypot(w, h)
    t = _tables([[1, 3], [3, 1]], dist=0.2, size=(0.1, 0.15))
    victim = [70.0, 50.0, 90.0, 70.0]  # centre (80, 60)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        u = torch.rand(7, generator=gen).tolist()
        box = helper_box(victim, 0, 1, t, h, w, u)
        assert box == helper_box(victim, 0, 1, t, h, w, u)
        bh, bw = box[3] - box[1], box[2] - box[0]
        assert (bh, bw) == (2 * (int(0.1 * diag) // 2), 2 * (int(0.15 * diag) // 2))
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        assert math.hypot(cx - 80, cy - 60) == pytest.approx(int(0.2 * diag), abs=1.5)
        assert 0 <= box[0] < box[2] <= w and 0 <= box[1] < box[3] <= h
        # near the top-right corner only the quadrant between left and down has room: the box is never clipped
        corner = helper_box([130.0, 10.0, 150.0, 30.0], 0, 1, t, h, w, u)
        assert (corner[3] - corner[1], corner[2] - corner[0]) == (bh, bw)
        assert corner[0] + bw / 2 <= 140 and corner[1] + bh / 2 >= 20


def test_helper_box_halves_the_distance_then_falls_back_to_a_random_place():
    h = w = 64
    diag = math.hypot(w, h)
    victim = [24.0, 24.0, 40.0, 40.0]  # centre (32, 32)
    u = [0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.75]
    near = helper_box(victim, 0, 1, _tables([[1, 3], [3, 1]], dist=0.5, size=(0.1, 0.1)), h, w, u)
    cx, cy = (near[0] + near[2]) / 2, (near[1] + near[3]) / 2
    assert math.hypot(cx - 32, cy - 32) == pytest.approx(0.5 * int(0.5 * diag), abs=1.5)  # halved: 45 px won't fit
    far = helper_box(victim, 0, 1, _tables([[1, 3], [3, 1]], dist=2.0, size=(0.1, 0.1)), h, w, u)
    side = int(0.1 * diag)
    x0, y0 = int(0.25 * (w - side + 1)), int(0.75 * (h - side + 1))
    assert far == [x0, y0, x0 + side, y0 + side]  # no quarter fits either: the random position
    unseen = helper_box(victim, 0, 1, _tables([[1, 0], [0, 1]], dist=0.1, size=(0.2, 0.2)), h, w, u)
    side = int(0.2 * diag)  # never seen together: the helper class's own size, at a random position
    x0, y0 = int(0.25 * (w - side + 1)), int(0.75 * (h - side + 1))
    assert unseen == [x0, y0, x0 + side, y0 + side]


def test_helper_box_truncates_the_room_to_whole_pixels():
    """Theirs compare the room in each direction as int(W - w / 2 - xc) etc. with the distance: with an 11 px
    helper around the centre of a 100 px image the room is 44.5 px, 44 once truncated, so a table distance of
    44 px fits in no direction and the box goes at half of it (a float room would take 44)."""
    diag = math.hypot(100, 100)
    t = _tables([[1, 3], [3, 1]], dist=44.5 / diag, size=(11.5 / diag, 11.5 / diag))
    for u in ([0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.75], [0.9, 0.2, 0.7, 0.4, 0.05, 0.5, 0.5]):
        box = helper_box([45.0, 45.0, 55.0, 55.0], 0, 1, t, 100, 100, u)
        assert (box[2] - box[0], box[3] - box[1]) == (10, 10)
        assert math.hypot((box[0] + box[2]) / 2 - 50, (box[1] + box[3]) / 2 - 50) == pytest.approx(22, abs=1.5)


@pytest.mark.parametrize("n_det,steps", [(2, 5), (1, 5), (7, 5), (3, 0), (3, 2)])
def test_sequential_plans_follow_the_authors_order(n_det, steps):
    """ap0 relabels the victim (moved to the first row); each later plan extends the one before, relabelling
    the next detection with a helper label (co-occurrence > 5 % with the target), then adding a helper box."""
    gen = torch.Generator().manual_seed(n_det)
    xy = torch.rand(n_det, 2, generator=gen) * 40
    boxes = torch.cat([xy, xy + 10 + torch.rand(n_det, 2, generator=gen) * 10], 1)
    labels = torch.randint(0, 3, (n_det,), generator=gen)
    t = _tables([[4, 0, 6, 1], [0, 1, 1, 1], [6, 1, 2, 1], [1, 1, 1, 1]])
    victim, target = n_det // 2, 3
    plans = sequential_plans(boxes, labels, victim, target, t, 64, 64, steps,
                             torch.rand(steps, U_STEP, generator=gen))
    assert len(plans) == steps + 1
    b0, l0 = plans[0]
    order = [victim] + [i for i in range(n_det) if i != victim]
    assert torch.equal(b0, boxes[order]) and l0[0] == target and torch.equal(l0[1:], labels[order][1:])
    allowed = set(torch.nonzero(helper_distribution(t, target)).flatten().tolist())
    for k in range(1, steps + 1):
        (bp, lp), (b, lab) = plans[k - 1], plans[k]
        assert torch.equal(b[:len(bp)], bp)
        if k < n_det:  # relabel detection k, keep the rest
            assert len(lab) == n_det and int(lab[k]) in allowed
            assert torch.equal(lab[:k], lp[:k]) and torch.equal(lab[k + 1:], lp[k + 1:])
        else:  # add one helper object inside the image
            assert len(lab) == len(lp) + 1 and torch.equal(lab[:-1], lp) and int(lab[-1]) in allowed
            x0, y0, x1, y1 = b[-1].tolist()
            assert 0 <= x0 < x1 <= 64 and 0 <= y0 < y1 <= 64


@pytest.mark.parametrize("n_det", [1, 3, 7])
def test_vanish_plans_keep_the_first_k_plus_one_objects(n_det):
    """The authors' ``-vanish``: plan ap_k is the full plan's first k + 1 rows (the victim, the k objects relabelled
    or added so far), so detections not yet relabelled leave the annotation and are attacked towards background."""
    gen = torch.Generator().manual_seed(n_det)
    xy = torch.rand(n_det, 2, generator=gen) * 40
    boxes = torch.cat([xy, xy + 12], 1)
    labels = torch.randint(0, 3, (n_det,), generator=gen)
    t = _tables([[4, 0, 6, 1], [0, 1, 1, 1], [6, 1, 2, 1], [1, 1, 1, 1]])
    u = torch.rand(5, U_STEP, generator=gen)
    full = sequential_plans(boxes, labels, n_det - 1, 3, t, 64, 64, 5, u)
    hide = sequential_plans(boxes, labels, n_det - 1, 3, t, 64, 64, 5, u, vanish=True)
    assert [len(lab) for _, lab in hide] == [1, 2, 3, 4, 5, 6]
    for k, ((fb, fl), (hb, hl)) in enumerate(zip(full, hide)):
        assert torch.equal(hb, fb[:k + 1]) and torch.equal(hl, fl[:k + 1])
        if k + 1 >= n_det:  # every detection relabelled: the same plan as without vanish
            assert torch.equal(hl, fl)


def test_caa_vanish_descends_towards_the_shortened_plans(monkeypatch):
    """``vanish: true`` reaches the plans the craft descends towards: ap0 holds the victim alone (``first_hit``
    without a hit runs every plan; ``last`` runs the last one alone)."""
    import blackboxbench.detection.attacks as attacks

    seen = []
    monkeypatch.setattr(attacks, "descend", lambda ctx, models, w, targets, x0, it, a, **kw: (
        seen.append([len(t["labels"]) for t in targets]), (x0, 0.0))[1])
    dets = {"boxes": torch.tensor([[2., 2, 20, 20], [30, 30, 50, 50], [5, 40, 25, 60]]),
            "labels": torch.tensor([0, 1, 2]), "scores": torch.tensor([0.9, 0.8, 0.7])}
    monkeypatch.setattr(attacks, "pick_victims", lambda ctx, thr, u: [(dets, 1, 2)])
    monkeypatch.setattr(attacks, "hit", lambda *a: torch.zeros(1, dtype=torch.bool))
    t = _tables([[4, 0, 6, 1], [0, 1, 1, 1], [6, 1, 2, 1], [1, 1, 1, 1]])
    rng = SimpleNamespace(uniform=lambda shape: torch.rand(1, *shape, generator=torch.Generator().manual_seed(0)))
    ctx = SimpleNamespace(assets={"context": t}, problem=SimpleNamespace(x=torch.zeros(1, 3, 64, 64), n=1),
                          surrogates=[object()], model=None, rng=rng)
    for vanish, want in ((False, [3, 3, 3, 4, 5, 6]), (True, [1, 2, 3, 4, 5, 6])):
        seen.clear()
        caa(ctx, None, steps=5, context="context", vanish=vanish, select="first_hit")  # never hits: every plan
        assert [s[0] for s in seen] == want
        seen.clear()
        caa(ctx, None, steps=5, context="context", vanish=vanish)  # select last: the last plan alone
        assert [s[0] for s in seen] == want[-1:]


class _FlipLoss:
    """A surrogate stub whose training loss is s * sum(c * x): the descent moves pixel i along -s c_i, with s = -1
    for the first ``k`` calls, then +1 (the descent turns back)."""

    def __init__(self, c, k):
        self.c, self.k, self.calls = c, k, 0

    def losses(self, x, targets):
        self.calls += 1
        return {"l": (-1.0 if self.calls <= self.k else 1.0) * (self.c * x).sum()}


def test_caa_descent_clips_in_the_loss_as_theirs(monkeypatch):
    """Theirs (run_sequential_attack.py; utils_mmdet.get_train_data) keep the perturbation clamped to +-eps alone
    and clip im + pert to [0, 255] inside the loss: a pixel pushed past 255 or 0 gets no gradient and stays there.
    Pixels 250, 100, 3 (eps 10, step 2, 6 steps, the descent turning back after 3): 250 -> 252, 254, then 256
    (clipped: frozen) -> 255; 3 -> 1, -1 (frozen) -> 0. Projecting every step instead (our old loop) lets the
    turn pull them back: 249 and 6."""
    import blackboxbench.detection.attacks as attacks
    from blackboxbench.threat import project

    x = torch.tensor([250.0, 100.0, 3.0]).view(1, 3, 1, 1) / 255
    dets = {"boxes": torch.tensor([[0.0, 0, 1, 1]]), "labels": torch.tensor([0]), "scores": torch.tensor([0.9])}
    monkeypatch.setattr(attacks, "pick_victims", lambda ctx, thr, u: [(dets, 0, 1)])
    eps = 10 / 255
    rng = SimpleNamespace(uniform=lambda shape: torch.zeros(1, *shape))
    ctx = SimpleNamespace(assets={}, rng=rng, model=None,
                          surrogates=[_FlipLoss(torch.tensor([1.0, 1.0, -1.0]).view(1, 3, 1, 1), 3)],
                          problem=SimpleNamespace(x=x, n=1, eps=eps, project=lambda z: project(z, x, eps, "linf")))
    out = caa(ctx, None, iterations=6, alpha=2 / 255, steps=0)
    assert (out.x * 255).round().flatten().tolist() == [255.0, 100.0, 0.0]


def test_random_helpers_reach_classes_the_context_excludes():
    """The authors' ``-random`` control: helper labels drawn uniformly, so a class without co-occurrence with the
    target (class 1 for target 0 here) becomes a helper too; the context draw never picks it."""
    t = _tables([[4, 0, 6], [0, 1, 1], [6, 1, 2]])
    boxes, labels = torch.tensor([[10., 10, 20, 20]]), torch.tensor([2])
    gen = torch.Generator().manual_seed(0)
    seen = {"context": set(), "random": set()}
    for _ in range(30):
        u = torch.rand(5, U_STEP, generator=gen)
        for mode in seen:
            plans = sequential_plans(boxes, labels, 0, 0, t, 64, 64, 5, u, random_helpers=mode == "random")
            seen[mode] |= set(plans[-1][1][1:].tolist())
    assert seen["context"] == {0, 2} and seen["random"] == {0, 1, 2}


def test_asset_default_and_config_errors(tmp_path):
    t = detection_context(None, "cpu", spec={"name": "shapes", "split": "train", "n": 32})
    assert t.num_classes == 3 and float(t.count.sum()) > 0
    with pytest.raises(BenchError, match=r"detection_context: spec.bogus: unknown parameter"):
        detection_context(None, "cpu", spec={"name": "shapes", "bogus": 1})
    with pytest.raises(BenchError, match="has no boxes"):
        detection_context(None, "cpu", spec={"name": "digits", "n": 4})
    base = {"dataset": {"name": "shapes", "n": 2}, "attack": "caa_10", "surrogates": ["shapes_fcos"],
            "targets": ["shapes_fcos"], "device": "cpu", "output_dir": str(tmp_path / "runs")}
    for assets, match in [({"context": {"name": "detection_context", "spec": {"name": "shapes", "n": 0}}},
                           r"assets.context.*spec.n"), ({}, "needs an asset named 'context'.*detection_context"),
                          ({"context": {"name": "detection_images"}}, r"assets.context.name.*a detection_context")]:
        exp = validate_experiment({**base, "assets": assets}, "test.yaml")
        exp.update(_source="test.yaml", _base_dir=".")
        with pytest.raises(ConfigError, match=match):
            run_experiment(exp, progress=False)
        assert not (tmp_path / "runs").exists()  # refused before anything ran
    # plan ap0 alone needs no context
    exp = validate_experiment({**base, "attack": {"recipe": "caa_10", "blocks": {"craft": {
        "steps": 0, "context": None, "iterations": 2}}}}, "test.yaml")
    exp.update(_source="test.yaml", _base_dir=".")
    _, summary = run_experiment(exp, progress=False)
    assert summary["n"] == 2
    with pytest.raises(BenchError, match="plans after ap0 need CAA's context tables"):
        caa(SimpleNamespace(assets={}, steps=1), None, steps=1, context=None)


def test_partial_asset_spec_completes_the_default():
    """``{n: 32}`` keeps the default's shapes train split (it used to lose the name: "unknown dataset 'None'")."""
    a = detection_context(None, "cpu", spec={"n": 32})
    b = detection_context(None, "cpu", spec={"name": "shapes", "split": "train", "n": 32})
    assert torch.equal(a.count, b.count) and torch.equal(a.size, b.size)


def test_context_tables_of_other_classes_are_refused():
    """CAA's tables index classes: tables of 3 classes against a 20-class dataset are a config error at the asset,
    before the run (it used to be an IndexError deep in the craft)."""
    fam = FAMILY.get("detection")
    tables = detection_context(None, "cpu", spec={"n": 8})
    craft = SimpleNamespace(func=SimpleNamespace(registry_meta={"name": "caa"}))
    attack = SimpleNamespace(craft=craft, meta={"assets": {"context": ("craft", "detection_context")}})
    data = SimpleNamespace(x=torch.zeros(1, 3, 64, 64), num_classes=20, name="voc2007")
    with pytest.raises(ConfigError, match="assets.context: its tables cover 3 classes, dataset voc2007 has 20"):
        fam._check_attack({}, data, "test.yaml", attack, {"context": tables})
    fam._check_attack({}, SimpleNamespace(**{**vars(data), "num_classes": 3}), "test.yaml", attack,
                      {"context": tables})


def test_objective_not_per_image_is_one_line():
    """A detection objective returns one value per image; a batch mean stops the craft with one line naming it."""
    from blackboxbench.detection.attacks import objective_grad

    def batch_mean(ctx, x):
        return x.mean()

    x = torch.rand(3, 3, 8, 8)
    with pytest.raises(BenchError) as e:
        objective_grad(None, batch_mean, x)
    assert str(e.value).startswith("objective 'batch_mean' (") and str(e.value).endswith(
        ") returned a tensor of shape () for 3 images: an objective returns one value per image, shaped (3,)")
    g = objective_grad(None, lambda ctx, z: z.flatten(1).sum(1), x)  # per image: the gradient of the sum
    assert torch.equal(g, torch.ones_like(x))


def test_helper_distribution_drops_a_class_at_exactly_five_percent():
    assert helper_distribution(_tables([[5, 95], [95, 0]]), 0).tolist() == [0.0, 1.0]


@pytest.mark.parametrize("u,expect", [(0.25, 0), (0.5, 2), (0.75, 2)])
def test_pick_at_a_cdf_step_takes_the_next_class(u, expect):
    """The inverse CDF of uniforms in [0, 1): u in [0, 0.5) draws the first class, [0.5, 1) the second."""
    assert pick(torch.tensor([0.5, 0.0, 0.5], dtype=torch.float64), u) == expect


def test_helper_box_quarters_the_distance_when_half_does_not_fit():
    """Centre (32, 32) of a 64 px image, a 9 px helper: 27 px of room in each direction. Table distance 72 px:
    36 px does not fit, 18 px does."""
    diag = math.hypot(64, 64)
    t = _tables([[1, 3], [3, 1]], dist=0.8, size=(0.1, 0.1))
    box = helper_box([24.0, 24.0, 40.0, 40.0], 0, 1, t, 64, 64, [0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.75])
    assert math.hypot((box[0] + box[2]) / 2 - 32, (box[1] + box[3]) / 2 - 32) == pytest.approx(int(0.8 * diag) / 4,
                                                                                             abs=1.5)


@pytest.mark.parametrize("seen", [True, False])
def test_helper_box_sides_are_at_least_two_pixels(seen):
    """A table size under a pixel gives a 2 px box, never a degenerate one (near the victim, or at a random place)."""
    t = _tables([[1, 3], [3, 1]] if seen else [[1, 0], [0, 1]], dist=0.1, size=(0.001, 0.001))
    box = helper_box([24.0, 24.0, 40.0, 40.0], 0, 1, t, 64, 64, [0.1, 0.2, 0.3, 0.4, 0.5, 0.25, 0.75])
    assert (box[2] - box[0], box[3] - box[1]) == (2, 2)
