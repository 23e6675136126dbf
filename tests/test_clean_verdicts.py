"""A sample's clean verdict (is it classified correctly? then it is attacked and counted) depends on the image only,
not on the batch it was checked in: on a GPU an image's logits move slightly with the batch size, and near a tie
the class can flip. The clean checks forward in calls of one shape (``family.audit_logits``: alone on a CPU), so
which samples a run attacks and counts, and its clean accuracy, do not depend on ``batch_size``."""
import pytest
import torch
from torch import nn

from attack_utils import build
from blackboxbench.defense import build_defenses
from blackboxbench.runner import run_tensors

EPS = 2 / 255


class NearTie(nn.Module):
    """Two classes: class 1 iff the image's mean is below 0.5, and in a call of more than one image class 0's logit
    is 2e-4 higher (a batch-dependent kernel, exaggerated): an image whose mean is within 2e-4 below 0.5 is
    correct alone and wrong in a batch."""

    def forward(self, x):
        s = x.flatten(1).mean(1)
        return torch.stack([s + (2e-4 if x.shape[0] > 1 else 0.0), 1 - s], 1)


def near_tie_images(n=6):
    """``n`` 3x4x4 images on the uint8 grid, label 1: image 0's mean sits 8e-5 below 0.5 (a near tie), the others are
    dark (far from the boundary)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(20, 60, (n, 3, 4, 4), generator=g).float()
    flat = torch.full((48,), 127.0)
    flat[:24] = 128.0
    flat[0] = 127.0  # sum 6119 of 6120 = 0.5 * 255 * 48
    x[0] = flat.view(3, 4, 4)
    return x / 255, torch.ones(n, dtype=torch.long)


def test_the_near_tie_model_flips_with_the_batch():
    x, y = near_tie_images()
    m = NearTie()
    with torch.no_grad():
        assert int(m(x[:1]).argmax(1)) == 1 and int(m(x).argmax(1)[0]) == 0
        assert (torch.cat([m(x[i:i + 1]) for i in range(len(x))]).argmax(1) == y).all()


def _verdicts_at_batch_sizes(recipe, models, read, defenses=None, **kw):
    """``read(record)`` for every record of ``recipe`` on the near-tie images (``defenses``: run_tensors' argument),
    at ``batch_size`` 1, 3 and 6."""
    x, y = near_tie_images()
    attack, t = build(recipe, "linf", eps=EPS, **kw)
    return {slots: [read(r) for r in run_tensors(attack, t, x, y, models, slots=slots, num_classes=2,
                                                 defenses=defenses)]
            for slots in (1, 3, 6)}


def test_a_query_runs_clean_checks_do_not_depend_on_the_batch_size():
    seen = _verdicts_at_batch_sizes("square_linf", {"model": [NearTie()]},
                                    lambda r: (r["clean_correct"], r["attacked"]), max_queries=20)
    assert seen[1] == seen[3] == seen[6], seen
    assert seen[6][0] == (True, True)  # image 0 is correct alone: attacked at every batch size


class Blind(nn.Module):
    """A surrogate with no gradient (logits 0 * x): I-FGSM returns the clean images unchanged."""

    def forward(self, x):
        return 0.0 * x.flatten(1)[:, :2]


def test_a_transfer_targets_clean_verdicts_do_not_depend_on_the_batch_size():
    seen = _verdicts_at_batch_sizes("i_fgsm", {"surrogates": [NearTie()], "targets": [NearTie()]},
                                    lambda r: r["targets"]["targets[0]"]["clean_correct"], iterations=2)
    assert seen[1] == seen[3] == seen[6] and seen[6][0], seen


def test_a_transfer_targets_success_does_not_depend_on_the_batch_size():
    """The returned near tie (the clean image: the surrogate gives no gradient) is not adversarial alone; in a
    batch the target would read it as class 0 (before 2026-12-05, twenty-sixth session, ``success`` was that
    batch's forward: True at batch sizes 3 and 6, False at 1)."""
    seen = _verdicts_at_batch_sizes("i_fgsm", {"surrogates": [Blind()], "targets": [NearTie()]},
                                    lambda r: (r["linf"], r["targets"]["targets[0]"]["success"]), iterations=2)
    assert seen[1] == seen[3] == seen[6] == [(0.0, False)] * 6, seen


def test_a_randomized_transfer_target_draws_its_clean_verdict_first():
    """Behind a randomized defense a transfer target's verdicts are draws from its own evaluation streams, the clean
    image's first, then the returned image's: the records equal a defended copy answering in that order (they
    would not with the two forwards swapped, which changes every sample's draws)."""
    from blackboxbench.defense import DefendedTarget, defense_streams, label, target_salt
    from blackboxbench.prep.models import build_model
    from blackboxbench.registry import DATASET

    data = DATASET.get("digits")(None, n=12)
    surrogate, target = build_model("digits_cnn"), build_model("digits_mlp")
    defenses = build_defenses([{"name": "rnd", "sigma": 0.4}])
    attack, t = build("i_fgsm", "linf", eps=0.1, iterations=2)
    records = run_tensors(attack, t, data.x, data.y, {"surrogates": [surrogate], "targets": [target]},
                          names={"surrogates": ["s"], "targets": ["t"]}, defenses={"targets": [defenses]})
    streams = defense_streams(0, len(data.y), torch.device("cpu"), target_salt(f"t={label(defenses, 't')}"))
    copy, who = DefendedTarget(target, defenses, streams, size=1), torch.arange(len(data.y))
    clean = (copy(data.x, who).argmax(1) == data.y).tolist()
    x_adv = torch.stack([r["x_adv"] for r in records])
    adv = (copy(x_adv, who).argmax(1) != data.y).tolist()
    assert [r["targets"]["t"]["clean_correct"] for r in records] == clean
    assert [r["targets"]["t"]["success"] for r in records] == adv
    assert all("audit_adv" not in r["targets"]["t"] for r in records)


# Behind a defense the verdicts not made by the attack (a query run's clean accuracy under the defense and its
# re-evaluation of the returned image, a transfer target's clean and adversarial verdicts) are draws from
# evaluation streams; the defended model answers them in the audit's calls of one shape too. `rnd` at sigma 0 (a
# randomized defense: majority draws) and `aaa_linear` with no steps (a deterministic one) leave the near-tie
# model's logits as they are: what moves its class is the batch.
DEFENSES = [[{"name": "rnd", "sigma": 0.0}], [{"name": "aaa_linear", "iterations": 0}]]


def _defended(specs, n, size):
    from blackboxbench.defense import EVAL_SALT, DefendedTarget, defense_streams

    streams = defense_streams(0, n, torch.device("cpu"), EVAL_SALT)
    return DefendedTarget(NearTie(), build_defenses(specs), streams, size=size)


@pytest.mark.parametrize("specs", DEFENSES, ids=lambda s: s[0]["name"])
def test_a_defended_evaluation_answers_each_image_as_alone(specs):
    from blackboxbench.defense import majority_adv

    x, y = near_tie_images()
    who = torch.arange(len(y))
    batched, alone = _defended(specs, len(y), None), _defended(specs, len(y), 1)
    assert int(batched(x, who).argmax(1)[0]) == 0  # the fixture: in a batch the near tie flips
    assert (alone(x, who).argmax(1) == y).all() and int(alone(x[:1], who[:1]).argmax(1)) == 1
    is_adv = lambda labels: labels != y[:len(labels)]  # noqa: E731
    adv, votes = majority_adv(alone, x, who, is_adv, 5)
    assert not adv.any() and votes.tolist() == [0] * len(y)


@pytest.mark.parametrize("specs", DEFENSES, ids=lambda s: s[0]["name"])
def test_a_defended_query_runs_clean_verdicts_do_not_depend_on_the_batch_size(specs):
    seen = _verdicts_at_batch_sizes("square_linf", {"model": [NearTie()]}, lambda r: r["clean_correct_defended"],
                                    {"model": [build_defenses(specs)]}, max_queries=20)
    assert seen[1] == seen[3] == seen[6] == [True] * 6, seen


@pytest.mark.parametrize("specs", DEFENSES, ids=lambda s: s[0]["name"])
def test_a_defended_transfer_targets_verdicts_do_not_depend_on_the_batch_size(specs):
    seen = _verdicts_at_batch_sizes("i_fgsm", {"surrogates": [NearTie()], "targets": [NearTie()]},
                                    lambda r: (r["targets"]["targets[0]"]["clean_correct"],
                                               r["targets"]["targets[0]"]["success"]),
                                    {"targets": [build_defenses(specs)]}, iterations=2)
    assert seen[1] == seen[3] == seen[6], seen
    assert seen[6][0][0], seen
