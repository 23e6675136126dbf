"""Install with ``pip install .``; the YAML catalogs (attacks/, defenses/, analysis/) ship inside the package as
``blackboxbench/_catalogs/<kind>`` so recipes are found from any working directory."""
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (HERE / "blackboxbench" / "__init__.py").read_text()).group(1)
CATALOGS = ("attacks", "defenses", "analysis")


class CleanBuildPy(build_py):
    """``build_py`` into an emptied ``build/lib``: setuptools reuses the folder of an earlier ``pip install .``, so
    a module or recipe deleted or moved in the checkout since would still be installed (a moved recipe then a
    duplicate name)."""

    def run(self):
        lib, here = Path(self.build_lib).resolve(), HERE.resolve()
        if not getattr(self, "editable_mode", False) and lib.is_dir() and lib not in (here, *here.parents):
            shutil.rmtree(lib)
        super().run()


setup(
    name="blackboxbench",
    version=VERSION,
    description="Black-box adversarial attacks composed from registered blocks, with a trustworthy leaderboard",
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["blackboxbench", "blackboxbench.*"])
    + [f"blackboxbench._catalogs.{c}" for c in CATALOGS],
    package_dir={f"blackboxbench._catalogs.{c}": c for c in CATALOGS},
    package_data={f"blackboxbench._catalogs.{c}": ["*.yaml", "*/*.yaml", "*/*/*.yaml", "*.md"] for c in CATALOGS},
    install_requires=["torch>=2.1", "torchvision", "timm", "numpy", "pyyaml", "scipy", "lpips", "pytorch-msssim", "torchmetrics", "matplotlib",
                      "tqdm", "scikit-learn", "greenlet"],
    extras_require={
        # -n 2 workers; pycocotools: the detection mAP cross-check; ai-edge-litert: the TFLite targets' tests;
        # scikit-image: QEBA-S's probe upsampling checked against the authors' skimage.transform.resize
        "test": ["pytest", "pytest-xdist", "pycocotools", "ai-edge-litert", "scikit-image"],
        "tflite": ["ai-edge-litert"],  # model "tflite": the data root's opaque quantized ImageNet classifiers
        # torchattacks pins an old `requests`: install it with `pip install --no-deps torchattacks`.
        "bench": ["adversarial-robustness-toolbox", "foolbox"],
        "ray": ["ray"],  # backend ray: sweeps across the machines of a Ray cluster (blackboxbench/sweep.py)
    },
    entry_points={"console_scripts": ["blackboxbench=blackboxbench.cli:main"]},
    cmdclass={"build_py": CleanBuildPy},
)
