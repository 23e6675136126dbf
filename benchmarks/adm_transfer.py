"""Adversarial divergence against transfer ASR (BlackboxBench Sec. IV, Fig. 14): the paper reads its AD matrix as
aligned with the transfer matrix, "the pair with higher ASR will report a lower Adversarial Divergence value".

Both matrices over the same models on CIFAR-10, untargeted Linf 0.03:
* transfer: I-FGSM (its recipe's Table VII defaults) from each model against every other, ASR over the first
  ``--n`` test images of cifar10_test_first100.npz that both classify correctly;
* AD: the ``adm`` recipe on the first ``--adm-n`` of the same images, each CAD a c-Glow trained on the 200
  images of cifar10_test_sdp200.npz (the recipe's: maximum likelihood of the model's MI-FGSM signs, 40 epochs;
  ``--cg-attack``: CG-Attack's adversarial-loss training, 10 epochs); on the CPU the c-Glow is the reduced one of
  configs/cifar10_cg_attack.yaml (16 / 32 / 32, depth 4) and KL takes ``--samples`` draws (the paper: 100,000).

It prints both matrices and the Spearman rank correlation of AD and ASR over the ordered pairs of distinct models
(the paper's reading: negative), and the same for KL.

    PYTHONPATH=$PWD BLACKBOXBENCH_DATA=/work/shared/data python benchmarks/adm_transfer.py --out /tmp/adm.md
"""
import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from blackboxbench.analysis.divergence import adversarial_divergence  # noqa: E402
from blackboxbench.analysis.inputs import load_inputs  # noqa: E402
from blackboxbench.prep.models import build_model  # noqa: E402
from blackboxbench.registry import DATASET  # noqa: E402
from fidelity_transfer_features import asr, build, emit, run_attack  # noqa: E402

MODELS = ["cifar_resnet20", "cifar_resnet56", "oval_cifar_wide", "cifar_cnn_a_mix"]
REDUCED = {"x_hidden_channels": 16, "x_hidden_size": 32, "y_hidden_channels": 32, "flow_depth": 4}


def ranks(v):
    order = np.argsort(v, kind="stable")
    r = np.empty(len(v))
    r[order] = np.arange(len(v))
    return r


def spearman(a, b):
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def table(title, names, m, fmt):
    lines = [f"{title}", "", "| surrogate \\ target | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {s} | " + " | ".join("-" if i == j else fmt.format(m[i][j]) for j in range(len(names))) + " |"
              for i, s in enumerate(names)]
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="*", default=MODELS)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--adm-n", type=int, default=20)
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--eps", type=float, default=0.03)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cg-attack", action="store_true",
                   help="CADs trained as CG-Attack's c-Glow (the adversarial loss alone, 10 epochs, batch 2: the "
                        "tool's first default) instead of the recipe's maximum likelihood of MI-FGSM signs")
    p.add_argument("--out", default=None, help="append the markdown to this file")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    root = os.environ.get("BLACKBOXBENCH_DATA", str(REPO.parent / "shared" / "data"))
    ds = DATASET.get("cifar10")(root, n=a.n, file="cifar10/cifar10_test_first100.npz")
    nets = {m: build_model(m, root) for m in a.models}
    k = len(a.models)
    rate = np.full((k, k), np.nan)
    t0 = time.process_time()
    atk = build("i_fgsm", a.eps)
    for i, s in enumerate(a.models):
        x_adv = run_attack(atk, nets[s], ds.x, ds.y, a.eps)[0]
        with torch.no_grad():
            keep = nets[s](ds.x).argmax(1) == ds.y
        for j, t in enumerate(a.models):
            if i != j:
                rate[i, j] = asr(nets[t], ds.x, x_adv, ds.y, keep)[0]
        print(f"{s}: " + " ".join(f"{t} {rate[i, j]:.2f}" for j, t in enumerate(a.models) if i != j), flush=True)
    transfer_s = time.process_time() - t0
    t0 = time.process_time()
    inputs = load_inputs(model=list(a.models), dataset={"name": "cifar10", "file": "cifar10/cifar10_test_first100.npz",
                                                         "n": a.adm_n}, data_root=root, many=True)
    cglow = {**REDUCED, "pretrain_epochs": 0, "epochs": 10, "batch": 2} if a.cg_attack else REDUCED
    _, _, arrays, _ = adversarial_divergence(inputs, eps=a.eps, samples=a.samples, **cglow)
    adm_s = time.process_time() - t0
    ad, kl, se = arrays["ad"], arrays["kl"], arrays["kl_se"]
    off = ~np.eye(k, dtype=bool)
    lines = [f"Untargeted Linf {a.eps}; I-FGSM on the first {a.n} images of cifar10_test_first100.npz ({transfer_s:.0f} "
             f"CPU s), ADM on the first {a.adm_n} with {a.samples} KL draws and the reduced c-Glow "
             f"{cglow} ({adm_s:.0f} CPU s with training, {a.threads} threads).", ""]
    lines += table("Transfer ASR (I-FGSM)", a.models, rate, "{:.2f}") + [""]
    lines += table("Adversarial divergence", a.models, ad, "{:.2f}") + [""]
    lines += table("KL (nats) +- standard error", a.models,
                   [[f"{kl[i, j]:.1f} +- {se[i, j]:.1f}" for j in range(k)] for i in range(k)], "{}") + [""]
    lines.append(f"Spearman over the {off.sum()} ordered pairs: AD vs ASR {spearman(ad[off], rate[off]):+.2f}, "
                 f"KL vs ASR {spearman(kl[off], rate[off]):+.2f} (the paper's reading: negative). Surrogates' "
                 f"margin on their c-Glow's training decodes before -> after training: "
                 + ", ".join(f"{m} {b:.2f} -> {c:.2f}" for m, (b, c) in zip(a.models, arrays["train_margin"])) + ".")
    emit(lines, a.out)


if __name__ == "__main__":
    main()
