"""Layer maps: named layers of every zoo architecture, for feature hooks and surgery (spec sheet gap G5).

:func:`layer_map` gives a model (a zoo :class:`~blackboxbench.prep.models.Normalized` classifier or a bare
network) a :class:`LayerMap` of portable names:

* ResNet layouts (the CIFAR ResNets; torchvision / timm ResNets: ``layer1`` .. ``layer4`` attributes):
  ``stem`` (the first ReLU when it is a module), ``stage1`` .. ``stageS`` (the output of each stage) and
  ``block{s}_{j}`` (block ``j`` of stage ``s``, from 0, as the authors' ``'3_1'`` / ``'4_0'`` positions);
* plain sequential networks (the digits models, the small CNNs of the data root): ``layer{i}`` (child ``i``) and
  ``stage1`` .. ``stageK``: the output of the k-th activation (conv/linear + activation = one stage);
* other timm / torchvision models with a ``stages``, ``features`` or ``blocks`` container: ``stage1`` ..
  ``stageK`` = its activations when it holds some (VGG), else its children;
* any other network (LeNet-5 of the data root): ``stage1`` .. ``stageK`` = its activation modules in order.

Every map has the roles ``mid`` (the feature layer of ILA, FIA and NAA: Table VII's ResNet-50 "2nd stage",
stage (S + 1) // 2 of S, the middle stage of a plain network) and ``late`` (LinBP's position: Table VII's CIFAR ResNet-50 "1st bottleneck of
the 4th stage" = the first block of the last stage; the second half of a plain network). Any module is also
reachable by its dotted path (``layer2.0.conv1``, ``net.`` prefix of the wrapper omitted). An unknown name is
a one-line error listing the valid names.
"""
import fnmatch
from dataclasses import dataclass, field
from typing import Dict

from torch import nn

from ..errors import BenchError
from ..registry import close_matches

ACTIVATIONS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Softplus, nn.Tanh, nn.Sigmoid)


def unwrap(model):
    """The network inside a zoo wrapper (``Normalized.net``), else the model itself."""
    net = getattr(model, "net", None)
    return net if isinstance(net, nn.Module) else model


@dataclass
class LayerMap:
    arch: str
    root: nn.Module
    layers: Dict[str, nn.Module] = field(default_factory=dict)
    roles: Dict[str, str] = field(default_factory=dict)

    def names(self):
        return list(self.roles) + list(self.layers)

    def resolve(self, name):
        """The map name behind ``name`` (a role resolves to its layer; a dotted path stays itself)."""
        return self.roles.get(name, name)

    def get(self, name, what="layer"):
        """The module named ``name``: a role, a map name or a dotted module path."""
        key = self.resolve(name)
        if key in self.layers:
            return self.layers[key]
        if isinstance(name, str) and "." in name or name in dict(self.root.named_children()):
            try:
                return self.root.get_submodule(name)
            except AttributeError:
                pass
        raise BenchError(f"unknown {what} '{name}' of {self.arch}{close_matches(name, self.names())}; valid "
                         f"names: {', '.join(self.names())} (or a module path such as "
                         f"'{next((n for n, _ in self.root.named_modules() if '.' in n), 'x.y')}')")


def _stage_roles(k, layers):
    return {"mid": f"stage{(k + 1) // 2}", "late": f"stage{k // 2 + 1}"} if k else {}


def _resnet_layout(net):
    stages = [getattr(net, f"layer{i}") for i in range(1, 5) if isinstance(getattr(net, f"layer{i}", None),
                                                                             nn.Sequential)]
    if not stages:
        return None
    layers = {}
    if isinstance(getattr(net, "relu", None), nn.Module):
        layers["stem"] = net.relu
    for s, stage in enumerate(stages, 1):
        layers[f"stage{s}"] = stage
        for j, block in enumerate(stage):
            layers[f"block{s}_{j}"] = block
    return layers, {"mid": f"stage{(len(stages) + 1) // 2}", "late": f"block{len(stages)}_0"}


def _container_layout(net):
    for attr in ("stages", "features", "blocks"):
        box = getattr(net, attr, None)
        if isinstance(box, (nn.Sequential, nn.ModuleList)) and len(box) > 1:
            acts = [m for m in box if isinstance(m, ACTIVATIONS)]  # VGG-style: conv + activation = a stage
            stages = acts or list(box)
            layers = {f"stage{i}": m for i, m in enumerate(stages, 1)}
            return layers, _stage_roles(len(stages), layers)
    return None


def _sequential_layout(net):
    if not isinstance(net, nn.Sequential):
        return None
    layers = {f"layer{i}": m for i, m in enumerate(net)}
    acts = [m for m in net.modules() if isinstance(m, ACTIVATIONS)]
    layers.update({f"stage{k}": m for k, m in enumerate(acts, 1)})
    return layers, _stage_roles(len(acts), layers)


def _activation_layout(net):
    acts = [m for m in net.modules() if isinstance(m, ACTIVATIONS)]
    if not acts:
        return None
    layers = {f"stage{k}": m for k, m in enumerate(acts, 1)}
    return layers, _stage_roles(len(acts), layers)


LAYOUTS = (_resnet_layout, _sequential_layout, _container_layout, _activation_layout)


def layer_map(model):
    """The :class:`LayerMap` of ``model`` (see the module docstring)."""
    net = unwrap(model)
    for layout in LAYOUTS:
        found = layout(net)
        if found is not None:
            return LayerMap(type(net).__name__, net, *found)
    return LayerMap(type(net).__name__, net)


def arch_id(model):
    """The architecture name of ``model``: the one :func:`~blackboxbench.prep.models.build_model` gives it (the
    zoo name, e.g. ``cifar_resnet20``, or the architecture of a ``timm:`` / ``torchvision:`` / ``checkpoint``
    spec, e.g. ``resnet50``), else the network's class name in lower case."""
    return getattr(model, "arch_id", None) or type(unwrap(model)).__name__.lower()


def per_arch(value, model):
    """The value of a per-architecture parameter for ``model`` (Table VII gives some per surrogate architecture):
    ``value`` itself when it is a number, else the value of the first pattern of the mapping (``fnmatch``, in
    order, ``default`` aside) that matches :func:`arch_id`, else its ``default``."""
    if not isinstance(value, dict):
        return value
    name = arch_id(model)
    return next((v for k, v in value.items() if k != "default" and fnmatch.fnmatchcase(name, k)), value["default"])


def get_layer(model, name, what="layer"):
    return layer_map(model).get(name, what)


class FeatureTap:
    """A forward hook that keeps the latest output of one layer (``out``); a context manager that removes it."""

    def __init__(self, module):
        self.out = None
        self.handle = module.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        self.out = output

    def close(self):
        self.handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
