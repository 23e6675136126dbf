#!/usr/bin/env bash
# Run HERE, before a call of the device tool: puts what the device machine lacks into two folders that git ignores
# (listed in .git/info/exclude) and that the call carries:
#   .whl/      the peers as wheels (torchattacks, ART), greenlet (share_forwards), lpips and pytorch-msssim (the
#              per-sample perceptual metrics); the device image already has
#              torch, numpy, scipy, ...
#   .gpudata/  the CIFAR-10 images and the akamaster ResNets from the data root (about 10 MB)
# Usage: BLACKBOXBENCH_DATA=../shared/data bash benchmarks/device/prepare.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
data=${BLACKBOXBENCH_DATA:-../shared/data}
[ -f "$data/cifar10/cifar10_test_300.npz" ] || { echo "prepare.sh: no CIFAR-10 data under $data" >&2; exit 2; }
for p in /.whl/ /.gpudata/; do grep -qsxF "$p" .git/info/exclude || echo "$p" >> .git/info/exclude; done
rm -rf .whl .gpudata
mkdir -p .whl .gpudata/cifar10 .gpudata/models
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl torchattacks==3.5.1 adversarial-robustness-toolbox==1.20.1 greenlet lpips==0.1.4 \
    pytorch-msssim==1.0.0
cp "$data/cifar10/cifar10_test_300.npz" .gpudata/cifar10/
cp -r "$data/models/akamaster_resnet_cifar10" .gpudata/models/
du -sh .whl .gpudata
