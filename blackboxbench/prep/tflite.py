"""Opaque TFLite classifiers (registry ``MODEL`` entry ``tflite``): a target that the attacks can only query.

The data root's ``models/coral_imagenet_tflite/`` holds uint8-quantized MobileNets (data README): integer
arithmetic inside, uint8 RGB NHWC input at the model's own resolution, a uint8 softmax over 1001 classes (0 =
background) out, and no gradient anywhere. ``tflite:<file stem>`` wraps one so that it looks like every other
zoo model from the outside: [0, 1] NCHW images in, one row of scores per image out.

What the wrapper does to an image, in order (the "camera" in front of the black box):
1. resize to the model's resolution, bilinear with antialiasing (as the data README's top-1 figures were measured:
   the whole image resized bilinearly), when the size differs;
2. round to uint8 (the model's input type: a perturbation below half a grey level of the resized image is lost);
3. one interpreter call per image (the files fix the batch at 1: their final reshape is to [1, 1001], which
   neither XNNPACK nor the reference kernels can resize), on the CPU, whatever the run's device;
4. the quantized probabilities dequantized, the background column dropped (the 1000 remaining columns follow
   torchvision's class order, the NIPS-2017 ``label_1000``), and returned as log-probabilities, a zero
   probability counted as half a quantum (log(1/512) = -6.24), so that the margin and cross-entropy losses of
   the score attacks stay finite.

The scores are a deterministic function of the image (integer kernels; tested), so the model is batch-invariant
and never flagged as randomized. Asking it for a gradient is a one-line error: it cannot be a surrogate.
Needs the ``ai-edge-litert`` package (``pip install ".[tflite]"``).
"""
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import BenchError
from ..registry import MODEL
from .data import data_path

TFLITE_DIR = "models/coral_imagenet_tflite"


def _interpreter(path, threads):
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        raise BenchError("model 'tflite' needs the ai-edge-litert package: pip install ai-edge-litert "
                         "(or pip install \".[tflite]\")") from None
    try:
        interpreter = Interpreter(model_path=str(path), num_threads=threads)
        interpreter.allocate_tensors()
    except (RuntimeError, ValueError) as err:
        raise BenchError(f"model 'tflite': cannot load {path}: {str(err).splitlines()[0]}") from None
    return interpreter


class TFLiteClassifier(nn.Module):
    """A TFLite image classifier behind the zoo's interface: [0, 1] NCHW in, log-probabilities out (see the
    module docstring). No parameters, no gradient; ``opaque`` tells the runner not to copy it."""

    opaque = True

    def __init__(self, path, threads=None, background=True):
        super().__init__()
        self.path = Path(path)
        self.interpreter = _interpreter(self.path, threads or torch.get_num_threads())
        inp, out = self.interpreter.get_input_details()[0], self.interpreter.get_output_details()[0]
        if len(inp["shape"]) != 4 or inp["shape"][3] != 3 or inp["dtype"] != np.uint8:
            raise BenchError(f"model 'tflite': {self.path} does not take uint8 RGB NHWC images "
                             f"(input {inp['dtype'].__name__} {list(inp['shape'])})")
        self.input_index, self.output_index = inp["index"], out["index"]
        self.size = (int(inp["shape"][1]), int(inp["shape"][2]))
        self.out_scale, self.out_zero = out["quantization"] if out["dtype"] != np.float32 else (1.0, 0)
        self.first = 1 if background else 0
        self.num_classes = int(out["shape"][-1]) - self.first

    def __deepcopy__(self, memo):  # the interpreter cannot be copied; a copy would be the same black box
        raise TypeError("a TFLite model is not copied")

    def forward(self, x):
        if torch.is_grad_enabled() and x.requires_grad:
            raise BenchError(f"model 'tflite' ({self.path.name}) gives no gradient: it can be a target, not a "
                             "surrogate")
        if x.dim() != 4 or x.shape[1] != 3:
            raise BenchError(f"model 'tflite' expects (N, 3, H, W) images, got shape {tuple(x.shape)}")
        img = x.detach().to("cpu", torch.float32)
        if tuple(img.shape[-2:]) != self.size:
            img = F.interpolate(img, size=self.size, mode="bilinear", align_corners=False, antialias=True)
        pixels = (img.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
        raw = np.empty((len(pixels), self.num_classes + self.first), dtype=np.float32)
        for i in range(len(pixels)):  # the file fixes the batch at one image per call (module docstring)
            self.interpreter.set_tensor(self.input_index, pixels[i:i + 1])
            self.interpreter.invoke()
            raw[i] = self.interpreter.get_tensor(self.output_index)[0]
        probs = (torch.from_numpy(raw) - self.out_zero) * self.out_scale
        return probs[:, self.first:].clamp_min(self.out_scale / 2).log().to(x.device)


@MODEL.register("tflite", source="a local .tflite classifier (ai-edge-litert); data README: coral_imagenet_tflite",
                ranges={"threads": "int [1, inf)"})
def tflite_model(data_root, *, arch=None, path=None, threads=None, background=True):
    """The TFLite classifier ``arch`` (a file stem of the data root's ``models/coral_imagenet_tflite``, e.g.
    ``mobilenet_v2_1.0_224_quant``), or the file ``path`` (relative to the data root or absolute). ``threads``:
    the interpreter's (default: torch's). ``background``: the first output column is a background class to drop
    (the Coral files' 1001 outputs)."""
    if (arch is None) == (path is None):
        raise BenchError("model 'tflite': give either arch (tflite:<file stem>) or path, not both or neither")
    file = data_path(data_root, path if path is not None else f"{TFLITE_DIR}/{arch}.tflite")
    if not file.is_file():
        known = sorted(p.stem for p in file.parent.glob("*.tflite")) if file.parent.is_dir() else []
        raise BenchError(f"model 'tflite': missing file {file}"
                         + (f" (found: {', '.join(known)})" if known else ""))
    return TFLiteClassifier(file, threads, background)
