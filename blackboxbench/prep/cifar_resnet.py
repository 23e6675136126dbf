"""He et al. CIFAR ResNet-20/32/44/56 (option-A shortcuts), the layout of the akamaster checkpoints.

Architecture per ../shared/data/README.md: conv3x3 3->16, BN, ReLU; three stages of n BasicBlocks with 16/32/64
channels (n = 3, 5, 7, 9), stride 2 at the first block of stages 2 and 3; global average pooling; Linear 64->10.

Every operation that a hook or a surgery must reach is a named module (spec sheet gap G5): the ReLUs (``relu``,
``relu1``, ``relu2``), the option-A shortcut (``shortcut``) and the residual sum (``merge``, a
:class:`ResidualAdd` of the residual branch and the skip). None of them holds a parameter or a buffer, so the
state-dict keys are those of the akamaster checkpoints and the outputs are bit-identical to the functional form.
"""
import torch
from torch import nn
import torch.nn.functional as F

DEPTH_BLOCKS = {20: 3, 32: 5, 44: 7, 56: 9}


class Shortcut(nn.Module):
    """Option-A shortcut: identity, or stride-2 subsampling with ``pad`` zero channels on each side."""

    def __init__(self, pad=0):
        super().__init__()
        self.pad = pad

    def forward(self, x):
        if not self.pad:
            return x
        return F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad))


class ResidualAdd(nn.Module):
    """The residual sum ``branch + skip`` of a residual block, as a module so that surgery can replace it."""

    def forward(self, branch, skip):
        return branch + skip


class BasicBlock(nn.Module):
    """``relu2(merge(branch(x), shortcut(x)))`` with ``branch = bn2 . conv2 . relu1 . bn1 . conv1``.

    The residual-block protocol of :mod:`blackboxbench.transfer.surgery`: a ``branch`` method and the modules
    ``shortcut``, ``merge`` and ``relu2``.
    """

    def __init__(self, in_planes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = Shortcut(planes // 4 if (stride != 1 or in_planes != planes) else 0)
        self.merge = ResidualAdd()
        self.relu2 = nn.ReLU()

    def branch(self, x):
        return self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))

    def forward(self, x):
        return self.relu2(self.merge(self.branch(x), self.shortcut(x)))


class CifarResNet(nn.Module):
    def __init__(self, depth=20, num_classes=10, in_channels=3, blocks=None, widths=(16, 32, 64)):
        super().__init__()
        n = blocks or DEPTH_BLOCKS[depth]  # blocks per stage (``blocks`` overrides the depth: the digits ResNet)
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU()
        planes, layers = widths[0], []
        for i, width in enumerate(widths):
            blocks = []
            for j in range(n):
                blocks.append(BasicBlock(planes, width, 2 if (i > 0 and j == 0) else 1))
                planes = width
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.linear = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.linear(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))
