#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE, as one call of the device tool (after benchmarks/device/prepare.sh here):
#   command: bash benchmarks/device/check.sh     carry: [".whl", ".gpudata"]     timeout_s: 420
# Prints every row as it finishes. Bar: the whole script within 6 minutes (360 s). Each section runs under a time
# budget (BUDGET_*_S; defaults 115 + 70 + 18 + 20 + 62 + 20 + 2 x 12 + 2 x 10 + 8 = 357 s, plus about 15 s of installs
# and start).
# Expected on the H200 machine (16 cores), estimated from the run of 2026-12-04 (benchmarks/RESULTS.md, "GPU run of
# 2026-12-04": 431 s, sections 1 and 2 cut by their budgets) and the CPU times in README's query table: about
# 260 s in all (15 + 95 + 60 + 10 + 13 + 50 + 15 + 3).
# 1. (budget 115 s, expected 80-110 s) Every query and transfer recipe of the CIFAR-10 configs (29 + 7 runs) on
#    the same N images with device cpu and cuda: ASR on each and the difference (bar: 3 points); the runner checks
#    every output and budget on both. Run one after the other (cpu then cuda) only 9 runs had finished at 190 s.
#    Now the CPU runs go to 12 spawned worker processes (one torch thread a run; 3 for the forward-heavy runs,
#    zo_signsgd and the L2 runs of ppba and nes, whose failing samples use the whole 10,000 queries) and the
#    CUDA runs to 4 processes sharing the GPU (one thread each), all at once (asr_cuda_vs_cpu.py --cpu-workers,
#    --wide, --cuda-workers). A row prints when both sides of its run are done; a run's seconds are measured
#    beside the others. The longest CPU runs (zo_signsgd L2: 247 s on one thread of a 2-core VM, README) and the
#    decision attacks start first: zo_signsgd L2 at ~60-90 s on 3 threads is the expected critical path; the
#    CUDA side (69 s for the 9 runs of 2026-12-04, ~190 s for all 36 one after the other) takes ~50-80 s on 4.
# 2. (budget 70 s, expected 55-65 s) The benchmark's throughput section on the GPU (wall time, images/s as a
#    share of the bare forward, model calls) against torchattacks' Square and ART's HopSkipJump. ART attacks one
#    image at a time in ~120 small calls per image (on the CPU: 6,096 calls for 49 images), each a host-to-GPU
#    copy, a launch-bound forward and the counting wrapper's syncs; on 2026-12-04 it also ran with TF32 (its
#    hits failed on many images, which then ran all 27 iterations) and twice (on the model, and like for like on
#    our inference copy): cut at 140 s. On the GPU, ART now runs once, on the first N_HSJA_PEER (20) correctly
#    classified HSJA images, with no like-for-like ART row (compare_peers.py --n-hsja-peer, --hsja-peer-same off)
#    and a 15 s cap per peer run (--peer-cap; a capped row says so); its row states the sample and the ratio line
#    compares wall per image. compare_peers.py's CPU defaults (RESULTS.md's CPU tables) are unchanged. Results
#    also land in $OUT.
# 3. (budget 18 s, expected 10 s) SI / Admix / SIA with hyper.copies_per_forward 1 (the default) and 0 (all
#    copies in one forward).
# 4. (budget 20 s, expected 13 s) Three query attacks on one target one after the other and sharing its forwards
#    (share_forwards).
# 5. (budget 62 s, expected 50 s) Seconds per image of OSFD, EBAD and CAA on torchvision's Faster R-CNN at 512 px
#    (resized to 800 by torchvision) with random weights (FCOS as the ensembles' second surrogate): the issue's
#    GPU figure against the od benchmark's 44 / 17 / 84 s.
# 6. (budget 20 s, expected 15 s) hsja_linf, hsja_l2 and qeba twice each on the same 16 images: identical records
#    (their estimates' per-sample sums no longer use CUDA's atomic index_add_; repeat_records.py).
# 7. (budget 2 x 12 s, expected 2 x 8 s) hsja_l2 and square_linf at batch sizes 16 and 5 on the same 16 images,
#    without fixed_batch (a control: how many records move with the batch size) and with fixed_batch 8 (bar:
#    identical records); then (budget 2 x 10 s, expected 2 x 7 s) the same for mi_fgsm crafted on ResNet-20 and
#    judged on ResNet-32/56 (fixed_batch covers the surrogate's gradients).
# 8. (budget 8 s, expected 3 s) The audit's forwards (family.audit_logits) on ResNet-20 and ResNet-56, 256 images:
#    ms an image batched, alone, and in calls of 32 padded images (the audit on CUDA); audit_cost.py.
# DEVICE=cpu and N/N_TP/N_HSJA/N_COPIES/N_SHARED/N_REPEAT (and DET_MODEL=shapes_fcos DET_EXTRA=shapes_fcos_b
# DET_SIZE=64) let the script itself be tried on a CPU machine (section 1 then runs the cpu side only, in min(12, nproc)
# workers; CPU_WORKERS sets it; the budgets are then BUDGET_SCALE = 4 times the above).
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
scale=${BUDGET_SCALE:-1}  # the budgets fit the device machine; a CPU dry run gets 4 times them
[ "$device" = cpu ] && scale=${BUDGET_SCALE:-4}
budget() { echo $(( $1 * scale )); }
devices=cpu,$device
[ "$device" = cpu ] && devices=cpu
cpu_workers=${CPU_WORKERS:-$(( $(nproc) < 12 ? $(nproc) : 12 ))}
timeout "$(budget "${BUDGET_ASR_S:-115}")" python3 benchmarks/device/asr_cuda_vs_cpu.py \
    configs/cifar10_query_all.yaml configs/cifar10_transfer.yaml --n "${N:-32}" --devices "$devices" \
    --cpu-workers "$cpu_workers" --cpu-threads 1 --wide zo_signsgd,ppba:l2,nes:l2 --wide-threads 3 \
    --cuda-workers "${CUDA_WORKERS:-4}" \
    --first zo_signsgd,hsja_linf,hsja_l2,nes,ppba,rays,bases,bandits_l2,babies 2>&1 | tee "$out/asr.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_TP_S:-70}")" python3 benchmarks/compare_peers.py --only throughput --device "$device" \
    --eps 8/255 --n-throughput "${N_TP:-300}" --n-hsja-throughput "${N_HSJA:-50}" --n-hsja-peer "${N_HSJA_PEER:-20}" \
    --hsja-peer-same off --peer-cap "${PEER_CAP_S:-15}" --out "$out/RESULTS_device.md" 2>&1 \
    | tee "$out/throughput.log" | grep '^|\|^-'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_COPIES_S:-18}")" python3 benchmarks/transfer_copies.py --device "$device" \
    --n "${N_COPIES:-100}" --repeats 2 2>&1 | tee "$out/copies.md"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_SHARED_S:-20}")" python3 benchmarks/shared_forwards.py --device "$device" \
    --n "${N_SHARED:-32}" --attacks square_linf,simba_dct,signhunter 2>&1 | tee "$out/shared.md" | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
rcnn="{name: torchvision_det, arch: fasterrcnn_resnet50_fpn, num_classes: 4, label_map: identity}"
fcos="{name: torchvision_det, arch: fcos_resnet50_fpn, num_classes: 4, label_map: identity}"
timeout "$(budget "${BUDGET_DET_S:-62}")" python3 benchmarks/detection_speed.py --device "$device" --n "${N_DET:-1}" \
    --size "${DET_SIZE:-512}" --score-thr 0.0 --max-det 20 --only osfd,ebad_10,caa_10 \
    --model "${DET_MODEL:-$rcnn}" --extra "${DET_EXTRA:-$fcos}" 2>&1 | tee "$out/detection.md" | grep '^|\|^model'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_REPEAT_S:-20}")" python3 benchmarks/device/repeat_records.py --device "$device" \
    --n "${N_REPEAT:-16}" hsja_linf:linf:0.03 hsja_l2:l2:1 qeba:linf:0.03 2>&1 | tee "$out/repeat.md" | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_FIXED_S:-12}")" python3 benchmarks/device/repeat_records.py --device "$device" \
    --n "${N_REPEAT:-16}" --batch-sizes 16,5 --control hsja_l2:l2:1 square_linf:linf:0.03 2>&1 \
    | tee "$out/fixed_control.md" | grep '^|'
timeout "$(budget "${BUDGET_FIXED_S:-12}")" python3 benchmarks/device/repeat_records.py --device "$device" \
    --n "${N_REPEAT:-16}" --batch-sizes 16,5 --fixed-batch 8 hsja_l2:l2:1 square_linf:linf:0.03 2>&1 \
    | tee "$out/fixed.md" | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
transfer=(--surrogates cifar_resnet20 --targets cifar_resnet32,cifar_resnet56 mi_fgsm:linf:0.03)
timeout "$(budget "${BUDGET_FIXED_T_S:-10}")" python3 benchmarks/device/repeat_records.py --device "$device" \
    --n "${N_REPEAT:-16}" --batch-sizes 16,5 --control "${transfer[@]}" 2>&1 | tee "$out/fixed_transfer_control.md" \
    | grep '^|'
timeout "$(budget "${BUDGET_FIXED_T_S:-10}")" python3 benchmarks/device/repeat_records.py --device "$device" \
    --n "${N_REPEAT:-16}" --batch-sizes 16,5 --fixed-batch 8 "${transfer[@]}" 2>&1 | tee "$out/fixed_transfer.md" \
    | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout "$(budget "${BUDGET_AUDIT_S:-8}")" python3 benchmarks/device/audit_cost.py --device "$device" \
    --n "${N_AUDIT:-256}" 2>&1 | tee "$out/audit_cost.md" | grep '^|'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
