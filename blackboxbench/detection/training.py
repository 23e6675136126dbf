"""Adversarial training of detectors (od-robustness benchmark, Sec. 4): a detector fine-tuned on a training set
of adversarial images from one attack, from a mix of attacks, or from a partially attacked set, as a zoo model
(``adv_finetuned``) that any detection config can attack and evaluate (configs/detection_adv_training.yaml).

The training set is the first ``n_train`` images of the shapes train split. The first ``fraction`` of them are
attacked, split between the attacks by their shares in the given order; the others stay benign; so no image has
two adversarial versions in one set (Sec. 4.2). Each attack is crafted white-box on the base detector with its
recipe's defaults (Sec. 4.1: "generated in a white-box configuration on the tested detector"); the boxes are the
ground truth. Fine-tuning: Adam at ``lr`` for ``steps`` batches of 8, BatchNorm frozen, seeded; the result is
cached in ``BLACKBOXBENCH_CACHE`` under a hash of its settings.
"""
import copy
import hashlib
import json

import torch

from ..errors import BenchError
from ..prep.models import build_model, cached_or_trained
from ..registry import MODEL
from ..rng import seeded
from .context import detection_context
from .data import detection_images, shapes
from .models import TINY_VERSION, Detector


def split_plan(n, attacks, fraction):
    """[(attack or None, [image indices])]: the first round(fraction * n) images split among ``attacks`` ({recipe:
    share}) by cumulative share, the rest benign (None). Every image is in exactly one group."""
    k = round(fraction * n)
    total = sum(attacks.values()) or 1.0
    plan, start, acc = [], 0, 0.0
    for i, (name, share) in enumerate(attacks.items()):
        acc += share / total
        end = k if i == len(attacks) - 1 else round(acc * k)
        plan.append((name, list(range(start, end))))
        start = end
    plan.append((None, list(range(k if attacks else 0, n))))
    return plan


# the assets an attack crafting a training set reads, by kind: images of another shapes seed than the detectors'
ATTACKER_ASSETS = {
    "detection_images": lambda root: detection_images(root, "cpu", spec={"name": "shapes", "split": "train", "n": 64,
                                                                         "seed": 1}),
    "detection_context": lambda root: detection_context(root, "cpu", spec={"name": "shapes", "split": "train",
                                                                           "n": 256, "seed": 1})}


def adversarial_images(base, data, name, index, seed=0, data_root=None):
    """The adversarial images (float, uint8 grid) of recipe ``name`` crafted white-box on ``base`` for images
    ``index`` of ``data``, with its recipe's default threat model."""
    from ..builder import build_attack, load_recipe
    from ..config import finish_threat
    from ..family import RunInputs
    from ..registry import FAMILY
    from ..rng import Streams
    from ..runner import schedule

    sub = data.subset(index)
    recipe, src = load_recipe(name, "adv_finetuned")
    fam = FAMILY.get(recipe["family"])
    if fam.name != "detection":
        raise BenchError(f"adv_finetuned: '{name}' is not a detection recipe")
    threat = finish_threat({}, recipe, fam, "adv_finetuned")
    attack = build_attack(recipe, threat, src)
    missing = [kind for _, kind in attack.meta["assets"].values() if kind not in ATTACKER_ASSETS]
    if missing:
        raise BenchError(f"adv_finetuned: '{name}' reads a {missing[0]} asset, which a training set cannot be "
                         f"crafted with (known: {', '.join(ATTACKER_ASSETS)})")
    assets = {k: ATTACKER_ASSETS[kind](data_root) for k, (_, kind) in attack.meta["assets"].items()}
    run = RunInputs(attack=attack, threat=threat, data=sub,
                    models={"surrogates": [base], "targets": [base]}, model_names={"surrogates": ["b"],
                                                                                    "targets": ["b"]},
                    streams=Streams(seed, len(index), "cpu"), device=torch.device("cpu"), slots=32, assets=assets,
                    save_adv=True)
    records = []
    schedule(fam.worker(run), range(len(index)), records.extend, lambda _: None)
    records.sort(key=lambda r: r["index"])
    return torch.stack([r["_image"].float() / 255 for r in records])


def finetune(base, x, targets, *, steps, lr, seed, batch=8):
    """A copy of detector ``base`` fine-tuned on images ``x`` with ``targets`` (dataset labels)."""
    model = copy.deepcopy(base)
    net = model.net
    net.requires_grad_(True)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=lr)
    mt = model.to_model_targets(targets)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with seeded(seed):
            for _ in range(steps):
                idx = torch.randint(0, len(x), (batch,), generator=gen).tolist()
                model._loss_mode(True)
                losses = net([x[i] for i in idx], [mt[i] for i in idx])
                opt.zero_grad()
                sum(losses.values()).backward()
                opt.step()
    finally:
        torch.set_num_threads(threads)
        net.eval()
    model.requires_grad_(False)
    return model


@MODEL.register("adv_finetuned", task="detection", paper="od-robustness benchmark Sec. 4 (Tables 6-9, Figure 6)",
                ranges={"fraction": "[0, 1]", "n_train": "int [8, inf)", "steps": "int [1, inf)", "lr": "(0, 1)",
                        "seed": "int [0, inf)"})
def adv_finetuned(data_root=None, *, arch="variant", base="shapes_fcos", attacks=None, fraction=1.0, n_train=96,
                  steps=150, lr=1e-3, seed=0):
    """``base`` fine-tuned on the shapes train split with adversarial images of ``attacks`` ({recipe: share} or a
    list of recipes with equal shares; none: benign fine-tuning) on the first ``fraction`` of the ``n_train``
    images. ``arch`` only names the variant in tables (``adv_finetuned:<label>``). Built once, then cached."""
    attacks = {a: 1.0 for a in attacks} if isinstance(attacks, (list, tuple)) else dict(attacks or {})
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0 for v in attacks.values()):
        raise BenchError(f"adv_finetuned: attack shares must be positive numbers, got {attacks}")
    settings = {"base": base, "attacks": attacks, "fraction": fraction if attacks else 0.0, "n_train": n_train,
                "steps": steps, "lr": lr, "seed": seed, "version": TINY_VERSION}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    model = build_model(base, data_root=data_root)
    if not isinstance(model, Detector):
        raise BenchError(f"adv_finetuned: base '{base}' is not a detector")

    def train():
        data = shapes(None, n=n_train, split="train")
        x = data.x.clone()
        for name, index in split_plan(n_train, attacks, settings["fraction"]):
            if name is not None and index:
                x[index] = adversarial_images(model, data, name, index, seed, data_root)
        return finetune(model, x, data.targets, steps=steps, lr=lr, seed=seed).net

    tuned = copy.deepcopy(model)
    tuned.net = cached_or_trained(tuned.net, f"adv_finetuned-{digest}.pt", train)
    return tuned
