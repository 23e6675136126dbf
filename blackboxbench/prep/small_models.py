"""The small pretrained CIFAR-10 and MNIST classifiers of the data root (data README, "Models"), as zoo entries.

``models/abcrown_small_cifar_mnist/`` (many adversarially trained: their entries carry ``defense="at"``) and
``models/advertorch_mnist_lenet5/``. The plain CNNs are ``nn.Sequential`` stacks whose indices match the
checkpoints' keys (``0.weight``, ``2.weight``, ``5.weight`` ...); the residual nets and LeNet-5 use the
checkpoints' module names. Every activation is a module (never functional), so forward hooks reach it.
The README's measured clean accuracies are in :data:`MEASURED` (tests/test_small_models.py checks them).
"""
from torch import nn

from ..errors import BenchError
from ..registry import MODEL
from .cifar_resnet import ResidualAdd
from .data import data_path
from .models import Normalized, _load_into, load_state

ABCROWN = "models/abcrown_small_cifar_mnist"
ADVERTORCH = "models/advertorch_mnist_lenet5"
CIFAR_ABCROWN_MEAN, CIFAR_ABCROWN_STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)
CNN_A_MEAN = (125.3 / 255, 123.0 / 255, 113.9 / 255)
CNN_A_STD = (63.0 / 255, 62.1 / 255, 66.7 / 255)
ERAN_CIFAR_MEAN, ERAN_CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)
OVAL_MEAN, OVAL_STD = (0.485, 0.456, 0.406), (0.225, 0.225, 0.225)


def _out(size, k, s, p):
    return (size + 2 * p - k) // s + 1


def conv_stack(in_shape, convs, hidden, classes=10, act=nn.ReLU):
    """Conv layers ``convs`` [(out, kernel, stride, pad), ...] each followed by ``act``, then Flatten and the
    Linear layers of widths ``hidden`` + [classes] with ``act`` between them: the layout of every plain CNN of
    the data root, with the same ``nn.Sequential`` indices as their checkpoints."""
    c, h, w = in_shape
    layers = []
    for out, k, s, p in convs:
        layers += [nn.Conv2d(c, out, k, s, p), act()]
        c, h, w = out, _out(h, k, s, p), _out(w, k, s, p)
    layers.append(nn.Flatten())
    width = c * h * w
    for i, n in enumerate(list(hidden) + [classes]):
        layers.append(nn.Linear(width, n))
        if i < len(hidden):
            layers.append(act())
        width = n
    return nn.Sequential(*layers)


class Block(nn.Module):
    """conv3x3-ReLU-conv3x3 plus shortcut (1x1 conv when stride or width change), then ReLU; biases, no BN."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        proj = stride != 1 or cin != cout
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride)) if proj else nn.Sequential()
        self.merge = ResidualAdd()  # the residual sum as a module (surgery reaches it; no state-dict key)
        self.relu2 = nn.ReLU()

    def branch(self, x):
        return self.conv2(self.relu1(self.conv1(x)))

    def forward(self, x):
        return self.relu2(self.merge(self.branch(x), self.shortcut(x)))


class SmallResNet(nn.Module):
    """alpha-beta-CROWN's ResNet "2b"/"4b": conv3x3 stride 2 to ``planes``, ``stages`` stages of two blocks at
    2 * planes (the first of each with stride 2), flatten, Linear(->100), ReLU, Linear(100->10)."""

    def __init__(self, planes, stages):
        super().__init__()
        self.conv1 = nn.Conv2d(3, planes, 3, 2, 1)
        self.relu = nn.ReLU()
        width, size = planes, 16
        for s in range(stages):
            setattr(self, f"layer{s + 1}", nn.Sequential(Block(width, 2 * planes, 2), Block(2 * planes, 2 * planes, 1)))
            width, size = 2 * planes, size // 2
        self.stages = stages
        self.flatten = nn.Flatten()
        self.linear1 = nn.Linear(width * size * size, 100)
        self.relu_fc = nn.ReLU()
        self.linear2 = nn.Linear(100, 10)

    def forward(self, x):
        x = self.relu(self.conv1(x))
        for s in range(self.stages):
            x = getattr(self, f"layer{s + 1}")(x)
        return self.linear2(self.relu_fc(self.linear1(self.flatten(x))))


class LeNet5(nn.Module):
    """advertorch's MNIST LeNet-5: conv3x3 1->32, ReLU, maxpool 2, conv3x3 32->64, ReLU, maxpool 2,
    Linear(3136->200), ReLU, Linear(200->10)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.relu1, self.pool1 = nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        self.conv2, self.relu2, self.pool2 = nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.linear1, self.relu3, self.linear2 = nn.Linear(3136, 200), nn.ReLU(), nn.Linear(200, 10)

    def forward(self, x):
        x = self.pool2(self.relu2(self.conv2(self.pool1(self.relu1(self.conv1(x))))))
        return self.linear2(self.relu3(self.linear1(self.flatten(x))))


CIFAR, MNIST = (3, 32, 32), (1, 28, 28)
CNN_A = ([(16, 4, 2, 1), (32, 4, 2, 1)], [100])
CONV_SMALL = ([(16, 4, 2, 0), (32, 4, 2, 0)], [100])


def _marabou(a, b):
    return [(a, 4, 2, 0), (b, 4, 2, 0)], [128, 64]


# name: (folder, file, dataset, architecture factory, mean, std, adversarially trained, measured accuracy %)
ENTRIES = {
    "cifar_resnet2b_adv": (ABCROWN, "cifar_resnet2b_adv.pth", "cifar10", lambda: SmallResNet(8, 1),
                           CIFAR_ABCROWN_MEAN, CIFAR_ABCROWN_STD, True, 75.0),
    "cifar_resnet4b_adv": (ABCROWN, "cifar_resnet4b_adv.pth", "cifar10", lambda: SmallResNet(16, 2),
                           CIFAR_ABCROWN_MEAN, CIFAR_ABCROWN_STD, True, 83.3),
    **{f"cifar_cnn_a_{v}": (ABCROWN, f"cifar_cnn_a_{v}.pth", "cifar10", lambda: conv_stack(CIFAR, *CNN_A),
                            CNN_A_MEAN, CNN_A_STD, True, acc)
       for v, acc in (("adv", 70.0), ("adv4", 59.3), ("adv_alt", 73.0), ("mix", 79.3), ("mix4", 75.0))},
    "oval_cifar_base": (ABCROWN, "oval_cifar_base.pth", "cifar10",
                        lambda: conv_stack(CIFAR, [(8, 4, 2, 1), (16, 4, 2, 1)], [100]), OVAL_MEAN, OVAL_STD,
                        False, 63.0),
    "oval_cifar_wide": (ABCROWN, "oval_cifar_wide.pth", "cifar10", lambda: conv_stack(CIFAR, *CNN_A),
                        OVAL_MEAN, OVAL_STD, False, 66.3),
    "oval_cifar_deep": (ABCROWN, "oval_cifar_deep.pth", "cifar10",
                        lambda: conv_stack(CIFAR, [(8, 4, 2, 1), (8, 3, 1, 1), (8, 3, 1, 1), (8, 4, 2, 1)], [100]),
                        OVAL_MEAN, OVAL_STD, False, 57.0),
    "eran_cifar_conv_small_pgd": (ABCROWN, "eran_cifar_conv_small_pgd.pth", "cifar10",
                                  lambda: conv_stack(CIFAR, *CONV_SMALL), ERAN_CIFAR_MEAN, ERAN_CIFAR_STD, True, 66.3),
    "cifar_conv_small_sigmoid": (ABCROWN, "cifar_conv_small_sigmoid.pth", "cifar10",
                                 lambda: conv_stack(CIFAR, *CONV_SMALL, act=nn.Sigmoid), ERAN_CIFAR_MEAN,
                                 ERAN_CIFAR_STD, False, 67.7),
    **{f"marabou_cifar_{v}": (ABCROWN, f"marabou_cifar_{v}.pth", "cifar10",
                              lambda a=a, b=b: conv_stack(CIFAR, *_marabou(a, b)), None, None, False, acc)
       for v, a, b, acc in (("small", 8, 16, 63.0), ("medium", 16, 32, 72.0), ("large", 32, 64, 78.0))},
    "mnist_cnn_a_adv": (ABCROWN, "mnist_cnn_a_adv.pth", "mnist", lambda: conv_stack(MNIST, *CNN_A), None, None,
                        True, 95.6),
    "eran_mnist_conv_small_nat": (ABCROWN, "eran_mnist_conv_small_nat.pth", "mnist",
                                  lambda: conv_stack(MNIST, [(16, 4, 2, 0), (32, 4, 2, 0)], [100]), (0.1307,),
                                  (0.3081,), False, 98.0),
    "mnist_madrycnn_no_maxpool_tiny": (ABCROWN, "mnist_madrycnn_no_maxpool_tiny.pth", "mnist",
                                       lambda: conv_stack(MNIST, [(4, 5, 2, 2), (8, 5, 2, 2)], [128]), None, None,
                                       False, 97.2),
    "mnist_lenet5_clntrained": (ADVERTORCH, "mnist_lenet5_clntrained.pt", "mnist", LeNet5, None, None, False, 98.4),
    "mnist_lenet5_advtrained": (ADVERTORCH, "mnist_lenet5_advtrained.pt", "mnist", LeNet5, None, None, True, 98.2),
}
MEASURED = {name: e[7] for name, e in ENTRIES.items()}
ADVERSARIALLY_TRAINED = frozenset(name for name, e in ENTRIES.items() if e[6])


def _entry(name):
    folder, file, _, arch, mean, std, _, acc = ENTRIES[name]

    def build(data_root, *, pretrained=True):
        net = arch()
        if pretrained:
            path = data_path(data_root, f"{folder}/{file}")
            if not path.is_file():
                raise BenchError(f"missing checkpoint {path}")
            _load_into(net, load_state(path), path)
        return Normalized(net, mean, std)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (f"{file} of the data root's {folder.split('/')[-1]} (data README; measured clean accuracy "
                     f"{acc} %). ``pretrained=False``: random init.")
    return build


for _name, _e in ENTRIES.items():
    MODEL.register(_name, dataset=_e[2], source=f"data root {_e[0]}/{_e[1]}",
                   defense="at" if _e[6] else None)(_entry(_name))
