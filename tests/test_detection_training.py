"""Adversarial training of detectors: the training-set plan never gives one image two adversarial versions and
keeps the benign share, and a fine-tuned variant is built once (white-box adversarial images on the base), then
read from the cache."""
import torch

from blackboxbench.detection.models import Detector
from blackboxbench.detection.training import adversarial_images, split_plan
from blackboxbench.prep.models import build_model


def test_split_plan_is_a_partition():
    plan = split_plan(10, {"a": 1.0, "b": 3.0}, 0.8)
    assert plan == [("a", [0, 1]), ("b", [2, 3, 4, 5, 6, 7]), (None, [8, 9])]
    for n, attacks, frac in [(96, {"a": 1.0}, 0.25), (96, {"a": 1, "b": 1, "c": 1}, 1.0), (7, {}, 1.0)]:
        groups = split_plan(n, attacks, frac)
        flat = sorted(i for _, idx in groups for i in idx)
        assert flat == list(range(n))  # every image exactly once
        adv = sum(len(idx) for name, idx in groups if name)
        assert adv == (round(frac * n) if attacks else 0)


def test_adv_finetuned_builds_and_caches():
    spec = {"name": "adv_finetuned", "arch": "t", "attacks": {"tog_vanishing": 1.0}, "fraction": 0.5, "n_train": 8,
            "steps": 3}
    base = build_model("shapes_fcos")
    tuned = build_model(spec)
    assert isinstance(tuned, Detector)
    changed = [k for k, v in tuned.net.state_dict().items() if not torch.equal(v, base.net.state_dict()[k])]
    assert changed
    again = build_model(spec)  # from the cache: the same weights
    assert all(torch.equal(v, again.net.state_dict()[k]) for k, v in tuned.net.state_dict().items())


def test_adversarial_images_are_white_box_and_bounded():
    from blackboxbench.detection.data import shapes

    base, data = build_model("shapes_fcos"), shapes(None, n=4, split="train")
    x = adversarial_images(base, data, "tog_vanishing", [1, 3])
    assert x.shape == (2, 3, 64, 64)
    d = (x - data.x[[1, 3]]).abs().flatten(1).amax(1)
    assert (d <= 8 / 255 + 1e-6).all() and (d > 0).all()


def test_training_sets_of_attacks_that_read_assets():
    """An attack that reads an asset (CAA its context tables, PhantomSponges its training images) crafts a training
    set too: the attacker's assets come from another shapes seed than the detectors' training images."""
    from blackboxbench.detection.data import shapes

    base, data = build_model("shapes_fcos"), shapes(None, n=2, split="train")
    for name, eps in [("caa_10", 10 / 255), ("phantom_sponges", None)]:
        x = adversarial_images(base, data, name, [0, 1])
        d = (x - data.x[[0, 1]]).flatten(1)
        assert x.shape == (2, 3, 64, 64) and (d.abs().amax(1) > 0).all()
        if eps:
            assert (d.abs().amax(1) <= eps + 1e-6).all()
