"""Detector zoo (registry ``MODEL``): every entry returns a :class:`Detector` taking [0, 1] NCHW images.

* ``shapes_fcos``, ``shapes_fcos_b``, ``shapes_fcos_c`` (three inits): tiny FCOS detectors
  (3-conv backbone, spec sheet section 4) trained on the synthetic shapes on first use, in seconds and deterministically, then cached in
  ``BLACKBOXBENCH_CACHE`` (as the digits models are); ``shapes_frcnn``, a tiny Faster R-CNN on the same backbone;
  ``shapes_fcos_deep``, the tiny FCOS on a small ResNet backbone (13 convolutions with BatchNorm, still stride 8),
  trained the same way: a second backbone architecture; ``shapes_fcos_r20``, the tiny FCOS on the body of the
  pretrained CIFAR-10 ResNet-20 (checkpoint from the data root), fine-tuned: pretrained features, as the authors'
  detectors have, on which OSFD's feature distortion works (benchmarks/RESULTS.md).
* ``torchvision_det:<arch>``: any torchvision detection architecture (Faster R-CNN, RetinaNet, FCOS, SSD,
  SSDlite, ...): random init, a local ``checkpoint``, or the COCO weights when torch.hub already caches them
  (never downloaded; a one-line error says where to put them). COCO labels are mapped to the dataset's classes
  (``label_map: voc``, spec sheet section 3; the other COCO classes are dropped).

The score threshold and the detection cap are harmonized per run by the detection family (threat keys
``score_thr`` and ``max_det``) and logged in every summary.
"""
from collections import OrderedDict

import torch
from torch import nn

from ..errors import BenchError
from ..prep.data import data_path
from ..prep.cifar_resnet import CifarResNet
from ..prep.models import (IMAGENET_MEAN, IMAGENET_STD, _hub_checkpoint, _load_into, cached_or_trained,
                           from_cached_weights, load_cifar_resnet, load_state, torchvision_weights)
from ..registry import MODEL
from ..rng import seeded
from .data import SHAPES, VOC_CLASSES, shapes

TWO_STAGE = ("fasterrcnn", "maskrcnn", "keypointrcnn")
ONE_STAGE = ("fcos", "retinanet", "ssd")  # heads with per-candidate class scores (Detector.candidates)
TINY_VERSION = "v2"  # bump when a tiny detector or its training changes (names the cache file)
TINY_SCORE_THR = 0.3  # the tiny detectors' own operating point (their scores are not calibrated like COCO models')
# VOC class -> torchvision COCO category id (91-entry numbering), spec sheet section 3
VOC_TO_COCO = (5, 2, 16, 9, 44, 6, 3, 17, 62, 21, 67, 18, 19, 4, 1, 64, 20, 63, 7, 72)


def _rng_free(fn, *args, seed=0):
    """Run ``fn`` under a forked global RNG seeded with ``seed`` (R-CNN heads sample proposals from it; a
    random init draws from it), leaving the caller's stream untouched."""
    with seeded(seed):
        return fn(*args)


class Detector(nn.Module):
    """A torchvision detection model behind [0, 1] NCHW input, with labels mapped to the dataset's class ids.

    ``label_map[k]``: the dataset class of model label k (-1: dropped). ``forward(x)`` returns one dict per image
    (``boxes`` xyxy in input pixels, ``scores``, ``labels``) with at most ``max_det`` detections of score
    >= ``score_thr``. For attacks: ``losses(x, targets)`` (the training losses, BatchNorm frozen, seeded),
    ``features(x)`` (the backbone body's feature maps) and ``candidates(x)`` (pre-NMS class scores (N, A, C) over
    the dataset's classes, for the one-stage heads)."""

    def __init__(self, net, label_map, kind):
        super().__init__()
        self.net, self.kind = net, kind
        self.register_buffer("label_map", torch.as_tensor(label_map, dtype=torch.long))
        inv = torch.zeros(int(self.label_map.max()) + 1, dtype=torch.long)
        for k, c in enumerate(self.label_map.tolist()):
            if c >= 0 and inv[c] == 0:
                inv[c] = k
        self.register_buffer("inverse_map", inv)
        self.own = self.defaults()  # the architecture's own post-processing (restored by harmonize(None, None))
        self.score_thr, self.max_det = self.own
        # every module of the net with its mode under losses (BatchNorm frozen): the attacks switch modes twice a
        # step, and net.train() / eval() walk the module tree (1.1 ms there and back on Faster R-CNN R50-FPN, 0.5 ms
        # as flags set from this list)
        self._loss_modes = [(m, not isinstance(m, nn.modules.batchnorm._BatchNorm)) for m in net.modules()]
        self.requires_grad_(False)
        self.eval()

    # ---------------------------------------------------------------- post-processing settings
    def _holder(self):
        return self.net.roi_heads if hasattr(self.net, "roi_heads") else self.net

    def defaults(self):
        h = self._holder()
        return float(getattr(h, "score_thresh", 0.0)), int(getattr(h, "detections_per_img", 100))

    def harmonize(self, score_thr=None, max_det=None):
        """Set the post-processing threshold and cap (None: the architecture's own); returns the pair."""
        h = self._holder()
        h.score_thresh = self.score_thr = float(self.own[0] if score_thr is None else score_thr)
        h.detections_per_img = self.max_det = int(self.own[1] if max_det is None else max_det)
        return self.score_thr, self.max_det

    # ---------------------------------------------------------------- inference
    def _map(self, out):
        labels = self.label_map[out["labels"].clamp(0, len(self.label_map) - 1)]
        keep = labels >= 0
        return {"boxes": out["boxes"][keep], "scores": out["scores"][keep], "labels": labels[keep]}

    def forward(self, x):
        self.net.eval()
        return [self._map(o) for o in self.net(list(x))]

    # ---------------------------------------------------------------- attack hooks
    def _loss_mode(self, on):
        """The net in training mode with BatchNorm frozen (``on``), or in eval mode: net.train() then BatchNorm's
        eval(), or net.eval(), as flags set on the modules listed at construction."""
        for m, train in self._loss_modes:
            m.training = on and train

    def to_model_targets(self, targets):
        return [{"boxes": t["boxes"].to(self.label_map.device).float().view(-1, 4),
                 "labels": self.inverse_map[t["labels"].to(self.label_map.device)]} for t in targets]

    def losses(self, x, targets):
        """{name: loss} of the model's training objective on images ``x`` and ``targets`` (dataset labels;
        empty targets allowed); differentiable in ``x``."""
        self._loss_mode(True)
        try:
            return _rng_free(self.net, list(x), self.to_model_targets(targets))
        finally:
            self._loss_mode(False)

    def features(self, x):
        """The feature maps of the backbone body's stages (before any neck), a list of (N, C, h, w)."""
        images, _ = self.net.transform(list(x))
        body = getattr(self.net.backbone, "body", self.net.backbone)
        if isinstance(body, nn.Sequential):  # a plain stack (the tiny detectors): every stage's output
            out, h = [], images.tensors
            for layer in body:
                h = layer(h)
                if isinstance(layer, (nn.ReLU, ResStage)):
                    out.append(h)
            return out
        out = body(images.tensors)
        return list(out.values()) if isinstance(out, dict) else [out]

    def two_stage_logits(self, x):
        """Two-stage (R-CNN) heads: per image, the RPN objectness logit of every anchor, (N, A), and the RoI head's
        class logits (background first) of the RPN's proposals, a list of (P_i, C + 1); differentiable in ``x``
        (the proposals' boxes are not, as in torchvision's RPN)."""
        self._two_stage()
        net = self.net
        images, _ = net.transform(list(x))
        feats = self._backbone(images)
        objectness, _ = net.rpn.head(list(feats.values()))
        proposals, _ = net.rpn(images, feats)
        pooled = net.roi_heads.box_roi_pool(feats, proposals, images.image_sizes)
        logits, _ = net.roi_heads.box_predictor(net.roi_heads.box_head(pooled))
        return torch.cat([o.flatten(1) for o in objectness], 1), list(logits.split([len(p) for p in proposals]))

    def proposals(self, x, nms_thresh=None):
        """Two-stage (R-CNN) heads: the RPN's proposals on images ``x``, a list of (P_i, 4) boxes in the resized
        images' pixels (no gradient): fixed targets that :meth:`proposal_scores` classifies on other images; and
        the resized images' sizes, a list of (h, w). ``nms_thresh``: the RPN's NMS threshold for this call (DAG
        raises it to 0.9 for denser proposals)."""
        self._two_stage()
        rpn, old = self.net.rpn, self.net.rpn.nms_thresh
        rpn.nms_thresh = old if nms_thresh is None else nms_thresh
        try:
            with torch.no_grad():
                images, _ = self.net.transform(list(x))
                proposals, _ = rpn(images, self._backbone(images))
        finally:
            rpn.nms_thresh = old
        return proposals, images.image_sizes

    def proposal_scores(self, x, proposals, log=False):
        """Two-stage heads: the RoI head's class probabilities (softmax with the background) of the given
        ``proposals`` on images ``x``, over the dataset's classes, (N, P, C) with P the most proposals of an image
        (rows past an image's own: 0); ``log``: their logarithms (log-softmax; padding rows 0), so that a
        difference of two classes is the difference of their logits; differentiable in ``x``."""
        self._two_stage()
        net = self.net
        images, _ = net.transform(list(x))
        pooled = net.roi_heads.box_roi_pool(self._backbone(images), proposals, images.image_sizes)
        logits, _ = net.roi_heads.box_predictor(net.roi_heads.box_head(pooled))
        probs = (torch.log_softmax if log else torch.softmax)(logits, -1)[:, (self.label_map >= 0).nonzero().flatten()]
        return nn.utils.rnn.pad_sequence(list(probs.split([len(p) for p in proposals])), batch_first=True)

    def box_class_scores(self, x, boxes):
        """Two-stage heads: the RoI head's class probabilities (softmax with the background) of ``boxes`` (a list of
        (k_i, 4) in ``x``'s pixels, as proposals) on images ``x``, over the dataset's classes, a list of (k_i, C)."""
        self._two_stage()
        images, _ = self.net.transform(list(x))
        scaled = [b.to(x) * b.new_tensor([s[1] / x.shape[-1], s[0] / x.shape[-2]] * 2).to(x)
                  for b, s in zip(boxes, images.image_sizes)]
        probs = self.proposal_scores(x, scaled)
        return [p[:len(b)] for p, b in zip(probs, boxes)]

    def _backbone(self, images):
        feats = self.net.backbone(images.tensors)
        return feats if isinstance(feats, dict) else OrderedDict([("0", feats)])

    def _two_stage(self):
        if self.kind not in TWO_STAGE:
            raise BenchError(f"this attack needs a two-stage head's RPN and RoI scores; the {self.kind} detector "
                             "has none")

    def candidates(self, x, boxes=False):
        """Pre-NMS per-candidate class scores over the dataset's classes, (N, A, C), differentiable; ``boxes``:
        also each candidate's decoded box, (N, A, 4) as x1, y1, x2, y2 in units of the (resized) image's width and
        height."""
        if self.kind not in ONE_STAGE:
            raise BenchError(f"this attack needs a one-stage head's candidate scores (FCOS, RetinaNet, SSD); the "
                             f"{self.kind} detector has none")
        images, _ = self.net.transform(list(x))
        feats = self.net.backbone(images.tensors)
        feats = list(feats.values()) if isinstance(feats, dict) else [feats]
        head = self.net.head(feats)
        logits = head["cls_logits"]
        if self.kind == "fcos":
            probs = torch.sqrt(torch.sigmoid(logits) * torch.sigmoid(head["bbox_ctrness"]))
        elif self.kind == "retinanet":
            probs = torch.sigmoid(logits)
        else:
            probs = torch.softmax(logits, -1)
        cols = (self.label_map >= 0).nonzero().flatten()
        if not boxes:
            return probs[..., cols]
        anchors, reg = torch.stack(self.net.anchor_generator(images, feats)), head["bbox_regression"]
        if self.kind == "fcos":
            decoded = self.net.box_coder.decode(reg, anchors)
        else:
            decoded = self.net.box_coder.decode_single(reg.reshape(-1, 4), anchors.reshape(-1, 4)).view_as(reg)
        hw = decoded.new_tensor(images.image_sizes)  # (N, 2): each image's size after the transform's resize
        return probs[..., cols], decoded / torch.cat([hw.flip(1), hw.flip(1)], 1)[:, None]


# ---------------------------------------------------------------- tiny detectors on the synthetic shapes

class TinyBackbone(nn.Module):
    """3 stride-2 3x3 convolutions with ``width`` channels (stride 8); ``body`` is the part OSFD distorts."""

    def __init__(self, width=32):
        super().__init__()
        layers, c = [], 3
        for _ in range(3):
            layers += [nn.Conv2d(c, width, 3, stride=2, padding=1), nn.ReLU(inplace=False)]
            c = width
        self.body = nn.Sequential(*layers)
        self.out_channels = width

    def forward(self, x):
        return OrderedDict([("0", self.body(x))])


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, the first of stride ``stride``, plus the identity
    (or a strided 1x1 convolution with BatchNorm where the shape changes), then ReLU."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=False)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + self.down(x))


class ResStage(nn.Sequential):
    """One stage of :class:`DeepTinyBackbone` (basic blocks, the first strided): its output is one of the feature
    maps :meth:`Detector.features` returns."""


class DeepTinyBackbone(nn.Module):
    """A small ResNet, stride 8: a 3x3 stem convolution (16 channels, BatchNorm, ReLU) and three stages of
    ``blocks`` basic blocks each, the first block of each of stride 2, ``widths`` channels (16, 32, 32): 13
    convolutions deep where :class:`TinyBackbone` is 3. ``body`` is the part OSFD distorts, as the authors' ResNet
    backbones (mmdetection's out_indices): the three stages' outputs, not the stem's."""

    def __init__(self, widths=(16, 32, 32), blocks=2, stem=16):
        super().__init__()
        layers, c = [nn.Sequential(nn.Conv2d(3, stem, 3, 1, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU())], stem
        for w in widths:
            layers.append(ResStage(BasicBlock(c, w, 2), *[BasicBlock(w, w) for _ in range(blocks - 1)]))
            c = w
        self.body = nn.Sequential(*layers)
        self.out_channels = c

    def forward(self, x):
        return OrderedDict([("0", self.body(x))])


class CifarResNetBody(nn.Module):
    """A CIFAR ResNet's convolutional body (:class:`CifarResNet`: a 3x3 stem with BatchNorm, then three stages of
    basic blocks, 16/32/64 channels, stride 4) as a detector backbone. With the akamaster checkpoint it carries
    natural-image features learnt on CIFAR-10, as the authors' detectors carry ImageNet-pretrained ResNets. ``body``
    is the part OSFD distorts: the three stages' outputs (the stem's is not one, as mmdetection's out_indices)."""

    def __init__(self, net):
        super().__init__()
        self.body = nn.Sequential(nn.Sequential(net.conv1, net.bn1, net.relu),
                                  *(ResStage(*stage) for stage in (net.layer1, net.layer2, net.layer3)))
        self.out_channels = net.linear.in_features

    def forward(self, x):
        return OrderedDict([("0", self.body(x))])


def _backbone(name, data_root=None):
    """The backbone of tiny detector ``name``, built before its head (so the head's random init is the same draw
    whatever the backbone's weights); ``data_root``: load a pretrained body's checkpoint (else random init)."""
    if name in PRETRAINED_BODY:
        net = CifarResNet(PRETRAINED_BODY[name])
        return CifarResNetBody(net if data_root is None else load_cifar_resnet(net, PRETRAINED_BODY[name], data_root))
    return DeepTinyBackbone() if name in DEEP else TinyBackbone(TINY[name][1])


def _tiny_net(name, num_classes, size, data_root=None):
    """Tiny detector ``name``: a one-stage FCOS or two-stage Faster R-CNN on its :func:`_backbone` for ``size`` x
    ``size`` images; a pretrained body's own input normalization (ImageNet's mean and std, as the checkpoint)."""
    from torchvision.models.detection import FCOS, FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.ops import MultiScaleRoIAlign

    kind, backbone = TINY[name][0], _backbone(name, data_root)
    mean, std = (IMAGENET_MEAN, IMAGENET_STD) if name in PRETRAINED_BODY else ([0.5] * 3, [0.25] * 3)
    common = dict(min_size=size, max_size=size, image_mean=list(mean), image_std=list(std))
    if kind == "fasterrcnn":  # anchors of 8-32 px, 4x4 RoI features, proposals and samples scaled to 64-px images
        return FasterRCNN(backbone, num_classes,
                          rpn_anchor_generator=AnchorGenerator(sizes=((8, 16, 32),), aspect_ratios=((1.0,),)),
                          box_roi_pool=MultiScaleRoIAlign(featmap_names=["0"], output_size=4, sampling_ratio=2),
                          representation_size=64, rpn_pre_nms_top_n_train=300, rpn_post_nms_top_n_train=50,
                          rpn_pre_nms_top_n_test=300, rpn_post_nms_top_n_test=100, rpn_batch_size_per_image=64,
                          box_batch_size_per_image=32, box_score_thresh=TINY_SCORE_THR, box_detections_per_img=100,
                          **common)
    anchors = AnchorGenerator(sizes=((16,),), aspect_ratios=((1.0,),))
    return FCOS(backbone, num_classes, anchor_generator=anchors, center_sampling_radius=2.0,
                score_thresh=TINY_SCORE_THR, detections_per_img=100, **common)


TINY = {"shapes_fcos": ("fcos", 32, 0), "shapes_fcos_b": ("fcos", 32, 1), "shapes_fcos_c": ("fcos", 32, 2),
        "shapes_frcnn": ("fasterrcnn", 32, 3), "shapes_fcos_deep": ("fcos", 32, 4), "shapes_fcos_r20": ("fcos", 32, 5)}
DEEP = {"shapes_fcos_deep"}  # on DeepTinyBackbone (width unused)
PRETRAINED_BODY = {"shapes_fcos_r20": 20}  # on CifarResNetBody: the akamaster ResNet of this depth (width unused)


def train_tiny(name, *, images=512, iterations=800, batch=8, lr=None, size=64, data_root=None):
    """Train tiny detector ``name`` on the shapes train split, deterministically (seeded init and shuffling, one
    CPU thread): Adam with a one-cycle schedule, the torchvision training losses. 800 steps: at 400 the detector
    found the boxes but barely told the classes apart (top label right on 62 % of the test objects, a median
    score gap of 0.06 to the next label on the same box), so every box carried every class above the score
    threshold and a mislabel attack could not lower CSR; at 800: 91 %, gap 0.45 (64 test images). ``lr``: None
    gives 5e-3, or 1e-3 to fine-tune a pretrained body (its checkpoint read from ``data_root``), whose features a
    larger step would wash out."""
    seed = TINY[name][2]
    pretrained_body = name in PRETRAINED_BODY
    lr = (1e-3 if pretrained_body else 5e-3) if lr is None else lr
    data = shapes(None, n=images, size=size, split="train")
    with seeded(seed):
        net = _tiny_net(name, len(SHAPES) + 1, size, data_path(data_root, ".") if pretrained_body else None)
        gen = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=iterations)
        targets = [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in data.targets]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            net.train()
            for _ in range(iterations):
                idx = torch.randint(0, images, (batch,), generator=gen).tolist()
                losses = net([data.x[i] for i in idx], [targets[i] for i in idx])
                opt.zero_grad()
                sum(losses.values()).backward()
                opt.step()
                sched.step()
        finally:
            torch.set_num_threads(threads)
    return net.eval()


def tiny_detector(name, pretrained=True, data_root=None):
    """Tiny detector ``name``, trained (from the cache, else trained now: a pretrained body's first training reads
    its checkpoint from ``data_root``) or at its random init (``pretrained=False``), the same every run."""
    kind, _, seed = TINY[name]
    net = _rng_free(_tiny_net, name, len(SHAPES) + 1, 64, seed=seed)
    if pretrained:
        net = cached_or_trained(net, f"{name}-{TINY_VERSION}.pt", lambda: train_tiny(name, data_root=data_root))
    return Detector(net, [-1, 0, 1, 2], kind)


def _register_tiny(name):
    kind, width, seed = TINY[name]

    def build(data_root=None, *, pretrained=True):
        return tiny_detector(name, pretrained, data_root)

    build.__name__ = build.__qualname__ = name
    label = {"fcos": "FCOS", "fasterrcnn": "Faster R-CNN"}[kind]
    body = ("small ResNet backbone (stem + 3 stages of 2 basic blocks, 16/32/32 channels, BatchNorm)"
            if name in DEEP else f"{width}-channel 3-conv backbone")
    steps = "800 steps, ~25 s (FCOS) or ~45 s (Faster R-CNN) on one core"
    if name in PRETRAINED_BODY:
        body = (f"the body of the pretrained CIFAR-10 ResNet-{PRETRAINED_BODY[name]} (akamaster checkpoint in the "
                "data root, stride 4), fine-tuned")
        steps = "800 steps at lr 1e-3, a minute or two on one core; the first training needs the data root"
    build.__doc__ = (f"Tiny {label} ({body}, init seed {seed}) trained on the synthetic shapes train split on first "
                     f"use ({steps}) and cached; ``pretrained=False``: random init.")
    MODEL.register(name, dataset="shapes", task="detection")(build)


for _name in TINY:
    _register_tiny(_name)


# ---------------------------------------------------------------- torchvision detectors

def _kind(arch):
    for k in ("fcos", "retinanet", "ssdlite", "ssd", "fasterrcnn", "maskrcnn", "keypointrcnn"):
        if arch.startswith(k):
            return "ssd" if k == "ssdlite" else k
    return arch


@MODEL.register("torchvision_det", source="torchvision.models.detection", task="detection",
                ranges={"num_classes": "int [2, inf)", "label_map": ("voc", "coco", "identity")})
def torchvision_det(data_root, *, arch, pretrained=False, checkpoint=None, num_classes=91, label_map="voc"):
    """A torchvision detection architecture: random init, a local ``checkpoint`` (path relative to the data root
    or absolute), or its DEFAULT COCO weights when torch.hub already caches them (never downloaded).
    ``label_map``: ``voc`` keeps the 20 VOC classes (COCO ids of spec sheet section 3, in VOC order), ``coco``
    the 80 COCO classes (contiguous), ``identity`` label k -> class k - 1 (a model trained on the dataset)."""
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models.detection)
    weights = torchvision_weights(arch, names, "torchvision detection", pretrained and checkpoint is None)
    kw = {"weights_backbone": None}
    if weights is None:
        kw["num_classes"] = num_classes
    try:  # random weights come from build_model's seeded stream
        net = from_cached_weights(lambda: torchvision.models.get_model(arch, weights=weights, **kw),
                                  f"torchvision_det:{arch}", weights and _hub_checkpoint(weights.url))
    except (ValueError, TypeError) as err:
        raise BenchError(f"torchvision_det:{arch}: {err}") from None
    if checkpoint is not None:
        path = data_path(data_root, checkpoint)
        _load_into(net, load_state(path), path)
    n = num_classes if weights is None else 91
    if label_map == "voc":
        lm = [-1] * n
        for c, coco in enumerate(VOC_TO_COCO):
            if coco < n:
                lm[coco] = c
    elif label_map == "coco":
        cats = [k for k, name in enumerate(torchvision.models.detection.FasterRCNN_ResNet50_FPN_Weights.DEFAULT
                                           .meta["categories"]) if name not in ("__background__", "N/A")]
        lm = [cats.index(k) if k in cats else -1 for k in range(n)]
    else:
        lm = [-1] + list(range(n - 1))
    if max(lm) < 0:
        raise BenchError(f"torchvision_det:{arch}: label_map '{label_map}' keeps no class of a {n}-class model")
    return Detector(net, lm, _kind(arch))


VOC_NAMES = VOC_CLASSES  # re-exported for configs/docs
