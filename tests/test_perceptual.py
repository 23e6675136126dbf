"""SSIM and LPIPS per sample (blackboxbench/perceptual.py). SSIM is checked against an independent NumPy
implementation of Wang et al. 2004 (Gaussian 11x11, sigma 1.5, K1 0.01, K2 0.03, valid region) and known values;
LPIPS' plumbing runs with a random trunk, and the trunk loader with a torchvision AlexNet state dict."""
import numpy as np
import pytest
import torch
from scipy.signal import convolve2d

from blackboxbench.errors import BenchError
from blackboxbench.perceptual import load_lpips, lpips_distance, ssim, ssim_window


def ssim_reference(a, b, win=11, sigma=1.5, k1=0.01, k2=0.03):
    """Per-channel SSIM map over the valid region, averaged; one image (C, H, W) in [0, 1]."""
    g = np.exp(-((np.arange(win) - win // 2) ** 2) / (2 * sigma ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = k1 ** 2, k2 ** 2
    out = []
    for x, y in zip(a.astype(np.float64), b.astype(np.float64)):
        f = lambda v: convolve2d(v, w, mode="valid")  # noqa: E731
        mx, my = f(x), f(y)
        vx, vy, cxy = f(x * x) - mx ** 2, f(y * y) - my ** 2, f(x * y) - mx * my
        s = ((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2))
        out.append(s.mean())
    return float(np.mean(out))


def test_ssim_matches_independent_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(4, 3, 32, 32, generator=g)
    adv = (x + 0.03 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    got = ssim(adv, x)
    want = [ssim_reference(adv[i].numpy(), x[i].numpy()) for i in range(4)]
    assert got.shape == (4,)
    assert np.allclose(got.numpy(), want, atol=1e-5)


def test_ssim_known_values_and_per_sample():
    x = torch.rand(3, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(ssim(x, x), torch.ones(3))
    # a constant image against itself shifted by d: luminance term only, (2 m (m + d) + c1) / (m^2 + (m+d)^2 + c1)
    a, b = torch.full((1, 1, 16, 16), 0.5), torch.full((1, 1, 16, 16), 0.6)
    c1 = 0.01 ** 2
    assert ssim(b, a).item() == pytest.approx((2 * 0.5 * 0.6 + c1) / (0.25 + 0.36 + c1), abs=1e-6)
    noisy = (x + 0.1).clamp(0, 1)
    assert torch.allclose(ssim(noisy, x)[1:], ssim(noisy[1:], x[1:]))  # a sample's value ignores its batch


def test_ssim_in_pieces_equals_one_call(monkeypatch):
    """A batch is measured in pieces of about ``SSIM_VALUES`` values (its float64 maps would hold ~15 times the
    batch at once): the values are those of one call, and an empty batch gives an empty result."""
    import blackboxbench.perceptual as perceptual

    g = torch.Generator().manual_seed(3)
    x = torch.rand(7, 3, 24, 24, generator=g)
    adv = (x + 0.05 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    whole = ssim(adv, x)
    import pytorch_msssim

    calls = []
    real = pytorch_msssim.ssim
    monkeypatch.setattr(pytorch_msssim, "ssim", lambda a, *args, **kw: calls.append(len(a)) or real(a, *args, **kw))
    monkeypatch.setattr(perceptual, "SSIM_VALUES", 2 * 3 * 24 * 24)  # pieces of 2 images: 2, 2, 2, 1
    assert torch.equal(ssim(adv, x), whole) and calls == [2, 2, 2, 1]
    assert ssim(adv[:0], x[:0]).shape == (0,)


def test_ssim_small_images_and_bad_shapes():
    assert ssim_window(8, 8) == 7 and ssim_window(32, 32) == 11 and ssim_window(10, 12) == 9
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    y = (x + 0.05).clamp(0, 1)
    assert ssim(y, x).numpy() == pytest.approx([ssim_reference(y[i].numpy(), x[i].numpy(), win=7)
                                                for i in range(2)], abs=1e-5)
    with pytest.raises(BenchError, match="ssim"):
        ssim(x, x[:1])


def test_lpips_plumbing_with_random_trunk():
    net = load_lpips(random_trunk=True)
    g = torch.Generator().manual_seed(3)
    x = torch.rand(3, 3, 32, 32, generator=g)
    y = (x + 0.2 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    d = lpips_distance(net, y, x)
    assert d.shape == (3,) and (d > 0).all()
    assert torch.allclose(lpips_distance(net, x, x), torch.zeros(3), atol=1e-6)
    assert torch.allclose(lpips_distance(net, y[:1], x[:1]), d[:1], atol=1e-5)


def test_lpips_in_pieces_equals_one_call(monkeypatch):
    """LPIPS goes through the network in the same pieces as SSIM (AlexNet's activations grow with the batch)."""
    import blackboxbench.perceptual as perceptual

    net = load_lpips(random_trunk=True)
    g = torch.Generator().manual_seed(4)
    x = torch.rand(5, 3, 32, 32, generator=g)
    y = (x + 0.2 * torch.randn(x.shape, generator=g)).clamp(0, 1)
    whole = lpips_distance(net, y, x)
    calls = []
    monkeypatch.setattr(net, "forward", lambda a, b: calls.append(len(a)) or type(net).forward(net, a, b))
    monkeypatch.setattr(perceptual, "SSIM_VALUES", 2 * 3 * 32 * 32)
    assert torch.allclose(lpips_distance(net, y, x), whole, atol=1e-6) and calls == [2, 2, 1]
    assert lpips_distance(net, y[:0], x[:0]).shape == (0,)


def test_lpips_trunk_loading_and_missing_trunk(tmp_path, monkeypatch):
    import torchvision

    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.warns(UserWarning, match="LPIPS column left empty"):
        assert load_lpips() is None
    with pytest.raises(BenchError, match="not found"):
        load_lpips(path=tmp_path / "nope.pth")
    alex = torchvision.models.alexnet()
    file = tmp_path / "hub" / "checkpoints" / "alexnet-owt-7be5be79.pth"
    file.parent.mkdir(parents=True)
    torch.save(alex.state_dict(), file)
    net = load_lpips()
    assert torch.equal(net.net.slice1[0].weight, alex.features[0].weight)
    assert torch.equal(getattr(net.net.slice5, "10").weight, alex.features[10].weight)
    torch.save({"x": torch.zeros(1)}, tmp_path / "bad.pth")
    with pytest.raises(BenchError, match="not torchvision's AlexNet"):
        load_lpips(path=tmp_path / "bad.pth")


def test_cli_prints_a_library_warning_on_one_line(tmp_path):
    """The missing-trunk warning of a run reaches the terminal as one line, as errors do (not Python's two-line
    ``file:line: UserWarning`` with the source line under it). A subprocess: pytest records warnings instead of
    printing them."""
    import os
    import subprocess
    import sys

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"dataset: {{name: digits, n: 2}}\nmodel: digits_mlp\nattack: square_linf\ndevice: cpu\n"
                   f"threat: {{norm: linf, eps: 0.1, max_queries: 5}}\noutput_dir: {tmp_path / 'out'}\n")
    env = {**os.environ, "TORCH_HOME": str(tmp_path / "torch")}  # no AlexNet trunk there
    done = subprocess.run([sys.executable, "-m", "blackboxbench.cli", "run", str(cfg), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if "LPIPS" in x]
    assert lines and all(x.startswith("warning: LPIPS column left empty") for x in lines), done.stderr
    assert "UserWarning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr


def test_ssim_matches_skimage_on_uint8_images():
    """On uint8-quantized images (what records measure) against scikit-image's Gaussian SSIM with the same
    conventions (sigma 1.5, truncated to 11 x 11, population covariances, data range 1, the border of half a
    window cropped: the valid region, channels averaged), down to float32 rounding."""
    structural_similarity = pytest.importorskip("skimage.metrics").structural_similarity
    g = torch.Generator().manual_seed(3)
    for c, h, w in [(3, 32, 32), (1, 28, 28), (3, 11, 40)]:
        x = torch.randint(0, 256, (3, c, h, w), generator=g) / 255.0
        adv = (x * 255 + torch.randint(-8, 9, x.shape, generator=g)).clamp(0, 255) / 255.0
        got = ssim(adv, x)
        want = [structural_similarity(adv[i].double().numpy(), x[i].double().numpy(), gaussian_weights=True,
                                      sigma=1.5, use_sample_covariance=False, data_range=1.0, channel_axis=0)
                for i in range(3)]
        assert np.allclose(got.numpy(), want, atol=1e-6), (c, h, w)


def test_ssim_small_images_use_the_reference_with_the_smaller_window():
    """Images under 11 px (the 8 x 8 digits: window 7; 5 x 9: window 5) against the NumPy reference with that
    window, a Gaussian of sigma 1.5 truncated to it and renormalized."""
    g = torch.Generator().manual_seed(4)
    for h, w in [(8, 8), (5, 9)]:
        x = torch.randint(0, 256, (2, 1, h, w), generator=g) / 255.0
        adv = (x * 255 + torch.randint(-20, 21, x.shape, generator=g)).clamp(0, 255) / 255.0
        win = ssim_window(h, w)
        want = [ssim_reference(adv[i].numpy(), x[i].numpy(), win=win) for i in range(2)]
        assert np.allclose(ssim(adv, x).numpy(), want, atol=1e-6)
