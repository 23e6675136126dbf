"""Audit tests for the analysis tools, the perceptual metrics and the defenses: numbers with a known definition
checked on tiny inputs against hand-computed or independent references."""
import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from blackboxbench.analysis import divergence, saliency
from blackboxbench.analysis.inputs import Inputs
from blackboxbench.analysis.saliency import (first_success, fools, frequency_saliency, fsm, full_gradients, fullgrad,
                                             fullgrad_map, fullgrad_path, radial_profile)
from blackboxbench.defense import DefendedTarget, build_defenses, defense_streams, label, majority_adv
from blackboxbench.errors import BenchError
from blackboxbench.perceptual import load_lpips, lpips_distance
from blackboxbench.prep.models import Normalized

from test_adm import _affine_cglow
from test_analysis_model import Linear, _Brightness, _brightness_path, small_net


def _adm_table(monkeypatch, n, samples, families=None):
    """The ADM tool on ``n`` random 8 x 8 images with two affine c-Glows as the models' CADs (no training)."""
    flows = {"a": _affine_cglow(0), "b": _affine_cglow(1)}
    monkeypatch.setattr(divergence, "_train_set", lambda inputs, train: None)
    monkeypatch.setattr(divergence, "fit_cglow", lambda models, *a: (flows[models[0]], torch.tensor(0.0)))
    x = torch.rand(n, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    inputs = Inputs("a", "a, b", x, torch.zeros(n, dtype=torch.long), list(range(10, 10 + n)),
                    models=[("a", "a"), ("b", "b")])
    return divergence.adversarial_divergence(inputs, samples=samples, families=families)


def test_adm_standard_error_is_that_of_the_draws(monkeypatch):
    """One draw per image (samples = images): the KL is the mean of the images' draws and its standard error the
    draws' sample standard deviation over sqrt(draws); each table row carries its pair's numbers."""
    header, rows, arrays, _ = _adm_table(monkeypatch, n=6, samples=6)
    draws = arrays["kl_per_image"]
    assert arrays["samples_per_image"] == 1 and draws.shape == (2, 2, 6)
    assert np.allclose(arrays["kl"], draws.mean(2), rtol=1e-12)
    assert np.allclose(arrays["kl_se"], draws.std(2, ddof=1) / np.sqrt(6), rtol=1e-9)
    assert arrays["kl"][0, 1] > 1 and arrays["kl"][1, 0] > 1 and (np.diag(arrays["kl"]) == 0).all()
    sim, ad = divergence.divergence_from_kl(arrays["kl"], 2.0)
    by_pair = {(r[1], r[2]): r[3:] for r in rows}
    for i, s in enumerate("ab"):
        for j, t in enumerate("ab"):
            assert by_pair[s, t][0] == arrays["kl"][i, j] and by_pair[s, t][1] == arrays["kl_se"][i, j]
            assert by_pair[s, t][3] == ad[i, j]


def test_adm_spreads_the_samples_evenly_over_the_images(monkeypatch):
    """``samples`` 5 over 2 images: ceil(5 / 2) = 3 draws per image, 6 in all; the KL is the mean of the per-image
    means (each image weighs alike); the family rows average the pairs across the families."""
    _, rows, arrays, _ = _adm_table(monkeypatch, n=2, samples=5, families={"a": "F", "b": "G"})
    assert arrays["samples_per_image"] == 3
    assert np.allclose(arrays["kl"], arrays["kl_per_image"].mean(2), rtol=1e-12)
    fam = {(r[1], r[2]): r[3] for r in rows if r[0] == "family"}
    assert fam["F", "G"] == pytest.approx(arrays["kl"][0, 1]) and fam["G", "F"] == pytest.approx(arrays["kl"][1, 0])
    assert np.isnan(fam["F", "F"]) and arrays["family_ad"][0, 1] == pytest.approx(arrays["ad"][0, 1])


def test_family_average_leaves_out_a_missing_entry():
    m = np.array([[0.0, np.nan, 2.0], [3.0, 0.0, 5.0], [6.0, 7.0, 0.0]])
    labels, fam = divergence.family_average(m, ["a", "b", "c"], {"a": "F", "b": "F", "c": "G"})
    assert labels == ["F", "G"] and fam[0, 0] == 3.0 and fam[0, 1] == 3.5 and fam[1, 0] == 6.5
    assert np.isnan(fam[1, 1])


def test_radial_profile_centre_and_rounding():
    """The zero frequency sits where fftshift puts it, (h // 2, w // 2), also for even sizes: a constant gradient's
    FSM is all at radius 0. Radii round to the nearest integer: on 5 x 5 the corners (2.83 from the centre) make
    radius 3 on their own, (1, 2) offsets (2.24) join radius 2."""
    m = fsm(torch.ones(1, 1, 4, 6))[0, 0].numpy()
    assert np.allclose(radial_profile(m), [24.0, 0, 0, 0, 0])
    m = np.zeros((5, 5))
    m[0, 0], m[0, 1], m[2, 4] = 8.0, 4.0, 2.0  # a corner, a (2, 1) offset, a (0, 2) offset
    prof = radial_profile(m)
    assert len(prof) == 4 and prof[3] == 2.0 and prof[2] == pytest.approx(6.0 / 12) and prof[1] == prof[0] == 0


def test_fullgrad_tool_rows_compare_the_clean_and_adversarial_maps():
    """The fullgrad tool's table: per image (its first ``max_images``), the predictions on the clean and on the
    adversarial image and the cosine of their maps; the maps are on the predicted class by default."""
    model = small_net()
    g = torch.Generator().manual_seed(7)
    x = torch.rand(3, 3, 8, 8, generator=g)
    x_adv = x.clone()
    x_adv[:, 0] = 0  # the first image's prediction moves
    with torch.no_grad():
        pred, pred_adv = model(x).argmax(1), model(x_adv).argmax(1)
    y = (pred + 1) % 5  # labels the model does not predict: the label's map is not the predicted class's
    inputs = Inputs(model, "m", x, y, [4, 5, 6], x_adv=x_adv)
    header, rows, arrays, _ = fullgrad(inputs, max_images=2)
    assert header[-2:] == ["predicted_adv", "cosine_clean_adv"] and len(rows) == 2
    clean, adv = fullgrad_map(model, x[:2], pred[:2], "label"), fullgrad_map(model, x_adv[:2], pred_adv[:2], "label")
    assert np.allclose(arrays["clean"], clean.numpy()) and np.allclose(arrays["adversarial"], adv.numpy())
    assert not np.allclose(arrays["clean"], fullgrad_map(model, x[:2], y[:2], "label").numpy())
    for k, row in enumerate(rows):
        a, b = clean[k].flatten().double().numpy(), adv[k].flatten().double().numpy()
        assert row[:4] == [4 + k, int(y[k]), int(pred[k]), int(pred_adv[k])]
        assert row[4] == pytest.approx(a @ b / np.linalg.norm(a) / np.linalg.norm(b), rel=1e-5)
    assert pred[0] != pred_adv[0] and len(fullgrad(inputs)[1]) == 3  # max_images 8: all 3


def test_lpips_maps_unit_images_as_the_lpips_package_does():
    """[0, 1] images reach LPIPS in [-1, 1]: the package's own ``normalize=True`` gives the same distances."""
    net = load_lpips(random_trunk=True)
    g = torch.Generator().manual_seed(8)
    x = torch.rand(2, 3, 32, 32, generator=g)
    y = (x + 0.3 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    with torch.no_grad():
        ref = net(y, x, normalize=True).flatten()
    assert torch.allclose(lpips_distance(net, y, x), ref, rtol=1e-5, atol=1e-7)


def test_fullgrad_completeness_without_affine_batchnorm_or_std():
    """FullGrad's completeness with a BatchNorm without affine parameters (its bias -mu / sqrt(var + eps)) and an
    input normalization without a std (its bias -mean)."""
    g = torch.Generator().manual_seed(9)
    torch.manual_seed(9)
    bn = nn.BatchNorm2d(4, affine=False)
    bn.running_mean.uniform_(-0.5, 0.5, generator=g)
    bn.running_var.uniform_(0.5, 2.0, generator=g)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), bn, nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    model = Normalized(net, mean=[0.4, 0.5, 0.6]).eval()
    x = torch.rand(3, 3, 4, 4, generator=g)
    f, inp, biases = full_gradients(model, x, torch.tensor([0, 1, 2]), "label")
    total = inp.flatten(1).sum(1) + sum(b.flatten(1).sum(1) for b in biases)
    assert len(biases) == 3 and torch.allclose(total, f, rtol=1e-5, atol=1e-5), (total, f)


def test_fsm_in_chunks_equals_one_pass(monkeypatch):
    """The FSM's gradients go through the model in chunks of images: each chunk with its own labels."""
    g = torch.Generator().manual_seed(10)
    model = Linear(torch.randn(4, 3, 6, 6, generator=g), torch.zeros(4))
    inputs = Inputs(model, "lin", torch.rand(5, 3, 6, 6, generator=g), torch.tensor([0, 1, 2, 3, 1]), list(range(5)))
    whole = frequency_saliency(inputs)[2]["fsm"]
    monkeypatch.setattr(saliency, "CHUNK", 2)
    assert np.allclose(frequency_saliency(inputs)[2]["fsm"], whole, rtol=1e-6)


class _Votes:
    """A stand-in defended target: answers class 1 to the first ``yes`` rows of each call, class 0 to the others."""

    def __init__(self, randomized, yes):
        self.randomized, self.yes, self.rows = randomized, yes, []

    def __call__(self, x, who):
        self.rows.append(len(x))
        out = torch.zeros(len(x), 2)
        out[:self.yes, 1] = 1.0
        return out


def test_majority_re_evaluation_is_strict_and_asks_a_deterministic_target_once():
    x, who = torch.zeros(1, 1, 2, 2), torch.tensor([0])
    is_adv = lambda labels: labels == 1  # noqa: E731
    for yes, expect in ((2, False), (3, True)):  # 2 of 4 is a tie, not a majority
        adv, votes = majority_adv(_Votes(True, yes), x, who, is_adv, 4)
        assert adv.tolist() == [expect] and votes.tolist() == [yes]
    target = _Votes(False, 1)
    adv, votes = majority_adv(target, x, who, is_adv, 5)
    assert target.rows == [1] and adv.tolist() == [True] and votes.tolist() == [1]


def test_run_pairing_tolerates_uint8_rounding_only():
    """A run's saved adversarial image may lie beyond eps by its uint8 rounding (Linf 1 / 255; L2 half a level per
    value, 0.5 / 255 sqrt(d)), not more."""
    from blackboxbench.analysis.inputs import _check_pairing

    x = torch.full((1, 1, 2, 2), 0.5, dtype=torch.float64)
    for delta, ok in ((0.1 + 1 / 255 - 1e-6, True), (0.1 + 1 / 255 + 1e-6, False)):
        x_adv = x.clone()
        x_adv[0, 0, 0, 0] += delta
        _pairing_ok(_check_pairing, x_adv, x, {"norm": "linf", "eps": 0.1}, ok)
    for scale, ok in ((1 - 1e-6, True), (1 + 1e-6, False)):  # every value 0.25 + 0.5 / 255 off: L2 0.5 + 1 / 255
        _pairing_ok(_check_pairing, x + scale * (0.25 + 0.5 / 255), x, {"norm": "l2", "eps": 0.5}, ok)


def _pairing_ok(check, x_adv, x, threat, ok):
    if ok:
        check(x_adv, x, [7], threat, "run")
    else:
        with pytest.raises(BenchError, match="adversarial image of index 7 is"):
            check(x_adv, x, [7], threat, "run")


def test_a_runs_models_are_its_surrogates_then_its_targets():
    from blackboxbench.analysis.inputs import _run_model

    cfg = {"surrogates": ["s1", {"name": "s2"}], "targets": ["t1", "t2"]}
    assert _run_model(cfg, "run", many=True) == ["s1", {"name": "s2"}, "t1", "t2"]
    assert _run_model(cfg, "run") == "t1"  # one model: a transfer run's first target
    assert _run_model({"model": "m", "surrogates": ["s"]}, "run", many=True) == ["s", "m"]


def test_fullgrad_path_of_a_decision_run_runs_to_its_end():
    """``end: auto`` cuts at the first success for transfer runs only: a decision run's path (a query attack,
    Figs. 30-32) runs to its final snapshot though it fools the model earlier."""
    model = _Brightness().eval()
    fooled = _brightness_path([26, 77, 115, 153, 179, 230])  # class 1 from step 6
    inputs = Inputs(model, "m", torch.from_numpy(fooled[1][:1]).float().div(255), torch.tensor([0]), [4],
                    paths={4: fooled}, family="decision")
    _, rows, arrays, _ = fullgrad_path(inputs, stages=6)
    assert [r[3] for r in rows] == [0, 2, 4, 6, 8, 10] and arrays["first_success"].tolist() == [-1]


def test_fullgrad_path_maps_are_on_each_snapshots_prediction():
    """Along a path each snapshot's map is on its own predicted class (the default score), not on the label, and
    the table's cosine compares it with the clean snapshot's map."""
    model = small_net()
    g = torch.Generator().manual_seed(11)
    images = torch.randint(0, 256, (4, 3, 8, 8), generator=g, dtype=torch.uint8)
    xs = images.float().div(255)
    with torch.no_grad():
        pred = model(xs).argmax(1)
    inputs = Inputs(model, "m", xs[:1], torch.tensor([3]), [2], paths={2: (np.arange(4) * 5, images.numpy())},
                    family="score")
    _, rows, arrays, _ = fullgrad_path(inputs, stages=4)
    ref = fullgrad_map(model, xs, pred, "label")
    assert 3 not in pred.tolist()  # the label is no snapshot's prediction
    assert np.allclose(arrays["maps"], ref.numpy(), atol=1e-6)
    flat = ref.flatten(1).double()
    assert [r[4] for r in rows] == pred.tolist() and [r[5] for r in rows] == pytest.approx(
        (flat @ flat[0] / flat.norm(dim=1) / flat[0].norm()).tolist(), rel=1e-5)


def test_a_targeted_run_toward_class_zero():
    """Target class 0 is a target: a prediction fools only when it is 0, not whenever it leaves the label."""
    assert fools(torch.tensor([0, 2, 1]), 1, 0).tolist() == [True, False, False]
    assert fools(torch.tensor([0, 2, 1]), 1).tolist() == [True, True, False]
    model = _Brightness().eval()  # classes 1, 1, 2 along this path from a clean class-0 image
    assert first_success(model, _brightness_path([26, 153, 179, 230])[1], 1, target=0) is None
    assert first_success(model, _brightness_path([26, 153, 26])[1], 1, target=0) == 2


def test_a_defended_target_answers_float32_logits_in_any_chunking():
    model = Linear(torch.randn(3, 1, 2, 2, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    x = torch.rand(5, 1, 2, 2, dtype=torch.float64)
    for chunk in (8, 2):  # one forward, then several
        out = DefendedTarget(model, [], defense_streams(0, 5, "cpu"), chunk=chunk)(x, torch.arange(5))
        assert out.dtype == torch.float32 and out.shape == (5, 3)


def test_defense_labels_write_floats_shortest():
    """The leaderboard's defense cell: float parameters in %g (6.0 -> 6, 1e-05 stays short), others as they are."""
    (aaa, rnd) = build_defenses([{"name": "aaa_linear"}, {"name": "rnd", "sigma": 1e-5}])
    assert str(aaa) == "aaa_linear(interval=6,reverse_step=1,calibration=5,iterations=100,lr=0.1,temperature=1)"
    assert label([aaa, rnd]) == f"{aaa}+rnd(sigma=1e-05)" and label([]) == "none"


def test_a_defended_target_is_randomized_when_any_of_its_defenses_is():
    streams = defense_streams(0, 1, "cpu")
    for specs, randomized in (([{"name": "jpeg"}], False), ([{"name": "jpeg"}, {"name": "rnd"}], True),
                              ([{"name": "rnd"}, {"name": "aaa_sine"}], True), ([], False)):
        assert DefendedTarget(None, build_defenses(specs), streams).randomized is randomized, specs


def _fake_run(tmp_path, config, saved):
    """A run directory: its resolved ``config`` and the adversarial PNGs ``saved`` ({index: uint8 array})."""
    (tmp_path / "adv").mkdir(parents=True)
    (tmp_path / "config.yaml").write_text(config)
    for i, a in saved.items():
        Image.fromarray(a).save(tmp_path / "adv" / f"{i:06d}.png")
    return tmp_path


def test_inputs_of_a_run_keep_its_seed_and_the_saved_images_in_the_dataset(tmp_path):
    """A run's analysis draws with the run's seed; by default it reads the images the run saved that the dataset
    (here 3 digits) holds, and an index one past the dataset's end is an error."""
    from blackboxbench.analysis.inputs import load_inputs

    digit = np.zeros((8, 8), np.uint8)
    run = _fake_run(tmp_path, "dataset: {name: digits, n: 3}\nmodel: digits_mlp\nseed: 5\n", {1: digit, 5: digit})
    inputs = load_inputs(run=run)
    assert inputs.index == [1] and inputs.seed == 5 and inputs.x_adv.shape == (1, 1, 8, 8)
    with pytest.raises(BenchError, match=r"image indices \[3\] are not in the dataset \(3 images\)"):
        load_inputs(model="digits_mlp", dataset={"name": "digits", "n": 3}, indices=[3])


def test_saved_colour_images_are_read_channels_first(tmp_path):
    from blackboxbench.analysis.inputs import _adv_images

    a = np.random.default_rng(0).integers(0, 256, (4, 6, 3), dtype=np.uint8)  # H 4, W 6
    got = _adv_images(_fake_run(tmp_path, "", {2: a}), [2])
    assert got.shape == (1, 3, 4, 6) and torch.equal(got[0, 1], torch.from_numpy(a[:, :, 1]).float() / 255)


def test_a_bad_parameter_names_whoever_set_it(tmp_path):
    """A parameter the tool rejects is reported against the command line when given there, else the recipe file."""
    from blackboxbench.analysis.recipes import COMMAND_LINE, _params, load_recipe
    from blackboxbench.errors import ConfigError

    recipe = tmp_path / "my_fsm.yaml"
    recipe.write_text("name: my_fsm\ntool: fsm\npaper: test\nparams: {score: logit}\n")
    path, r, tool = load_recipe(str(recipe), "model")
    with pytest.raises(ConfigError, match=f"^{recipe}:params.score"):
        _params(path, r, tool, {}, COMMAND_LINE)
    with pytest.raises(ConfigError, match=r"^command line \(--param\):params.score"):
        _params(path, {**r, "params": {}}, tool, {"score": "logit"}, COMMAND_LINE)
    assert _params(path, r, tool, {"score": "label"}, COMMAND_LINE) == {"score": "label"}  # the given one wins
    recipe.write_text("name: my_fsm\ntool: fsm\npaper: test\nwhere: {norm: linf}\n")
    with pytest.raises(ConfigError, match="only tools that read results take where"):
        load_recipe(str(recipe), "model")


def test_a_label_equal_to_the_number_of_classes_is_out_of_range(tmp_path):
    from blackboxbench.analysis.inputs import load_inputs

    (tmp_path / "imf" / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(tmp_path / "imf" / "a" / "0.png")
    dataset = {"name": "imagefolder", "path": str(tmp_path / "imf"), "grayscale": True}
    with pytest.raises(BenchError, match="outputs 10 classes but dataset imagefolder has labels up to 10"):
        load_inputs(model="digits_mlp", dataset={**dataset, "classes": {"a": 10}})
    assert load_inputs(model="digits_mlp", dataset={**dataset, "classes": {"a": 9}}).y.tolist() == [9]
