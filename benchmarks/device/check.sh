#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE, as one call of the device tool (after benchmarks/device/prepare.sh here):
#   command: bash benchmarks/device/check.sh     carry: [".whl", ".gpudata"]     timeout_s: 540
# Prints every row as it finishes; targets: within 8 minutes (timeout_s 540).
# 1. Every query and transfer recipe of the CIFAR-10 configs on the same N images with device cpu and cuda:
#    ASR on each and the difference (bar: 3 points); the runner checks every output and budget on both.
# 2. The benchmark's throughput section on the GPU (wall time, images/s as a share of the bare forward, model
#    calls) against torchattacks' Square and ART's HopSkipJump. Results also land in $OUT.
# 3. SI / Admix / SIA with hyper.copies_per_forward 1 (the default) and 0 (all copies in one forward).
# 4. Three query attacks on one target one after the other and sharing its forwards (share_forwards).
# 5. Seconds per image of OSFD, EBAD and CAA on torchvision's Faster R-CNN at 512 px with random weights (FCOS as
#    the ensembles' second surrogate): the issue's GPU figure against the od benchmark's 44 / 17 / 84 s.
# DEVICE=cpu and N/N_TP/N_HSJA/N_COPIES/N_SHARED (and DET_MODEL=shapes_fcos DET_EXTRA=shapes_fcos_b DET_SIZE=64)
# let the script itself be tried on a CPU machine.
set -uo pipefail
device=${DEVICE:-cuda}
out=${OUT:-/tmp/bbb_device_out}
mkdir -p "$out"
pip_in() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bbb_site "$@"; }
pip_in $(ls .whl/*.whl | grep -v /greenlet-) \
    || { echo "check.sh: installing the carried wheels failed (run prepare.sh, carry .whl)" >&2; exit 2; }
pip_in .whl/greenlet-*.whl 2>/dev/null \
    || echo "check.sh: greenlet's wheel (cp312) does not fit this Python: section 4 says so and the rest runs" >&2
export PYTHONPATH=/tmp/bbb_site:$PWD PYTHONUNBUFFERED=1 BLACKBOXBENCH_DATA=$PWD/.gpudata
export BLACKBOXBENCH_CACHE=/tmp/bbb_cache
python3 -c "import torch; print('torch', torch.__version__, 'cuda available:', torch.cuda.is_available())"
[ "$device" = cpu ] || nvidia-smi -L
status=0
devices=cpu,$device
[ "$device" = cpu ] && devices=cpu
timeout "${BUDGET_ASR_S:-200}" python3 benchmarks/device/asr_cuda_vs_cpu.py configs/cifar10_query_all.yaml \
    configs/cifar10_transfer.yaml --n "${N:-32}" --devices "$devices" --first hsja_linf,hsja_l2,rays 2>&1 | tee "$out/asr.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "${BUDGET_TP_S:-150}" python3 benchmarks/compare_peers.py --only throughput --device "$device" --eps 8/255 \
    --n-throughput "${N_TP:-300}" --n-hsja-throughput "${N_HSJA:-50}" --out "$out/RESULTS_device.md" 2>&1 \
    | tee "$out/throughput.log" | grep '^|\|^-'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "${BUDGET_COPIES_S:-60}" python3 benchmarks/transfer_copies.py --device "$device" --n "${N_COPIES:-100}" \
    --repeats 2 2>&1 | tee "$out/copies.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "${BUDGET_SHARED_S:-45}" python3 benchmarks/shared_forwards.py --device "$device" --n "${N_SHARED:-32}" \
    --attacks square_linf,simba_dct,signhunter 2>&1 | tee "$out/shared.md" | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
rcnn="{name: torchvision_det, arch: fasterrcnn_resnet50_fpn, num_classes: 4, label_map: identity}"
fcos="{name: torchvision_det, arch: fcos_resnet50_fpn, num_classes: 4, label_map: identity}"
timeout "${BUDGET_DET_S:-100}" python3 benchmarks/detection_speed.py --device "$device" --n "${N_DET:-1}" \
    --size "${DET_SIZE:-512}" --score-thr 0.0 --max-det 20 --only osfd,ebad_10,caa_10 \
    --model "${DET_MODEL:-$rcnn}" --extra "${DET_EXTRA:-$fcos}" 2>&1 | tee "$out/detection.md" | grep '^|\|^model'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
