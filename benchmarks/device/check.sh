#!/usr/bin/env bash
# Run ON THE DEVICE MACHINE, as one call of the device tool (after benchmarks/device/prepare.sh here):
#   command: bash benchmarks/device/check.sh     carry: [".whl", ".gpudata"]     timeout_s: 540
# 1. CUDA smoke: every query recipe (4 images) and every transfer recipe (16 images) through scripts/run.py with
#    device cuda; the runner checks every output (eps ball, [0, 1], uint8) and every budget.
# 2. The benchmark's seeds section (ours vs torchattacks Square, ours vs ART HSJA; 8/255, 3 seeds) on the GPU:
#    the comparison this CPU cannot decide (benchmarks/RESULTS.md). Results land in $OUT.
# DEVICE=cpu and SEEDS/N/N_HSJA/BUDGET_S let the script itself be tried on a CPU machine.
set -uo pipefail
device=${DEVICE:-cuda}
out=${OUT:-/tmp/bbb_device_out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/bbb_site .whl/*.whl \
    || { echo "check.sh: installing the carried wheels failed (run prepare.sh, carry .whl)" >&2; exit 2; }
export PYTHONPATH=/tmp/bbb_site:$PWD PYTHONUNBUFFERED=1 BLACKBOXBENCH_DATA=$PWD/.gpudata
export BLACKBOXBENCH_CACHE=/tmp/bbb_cache
python3 -c "import torch; print('torch', torch.__version__, 'cuda available:', torch.cuda.is_available())"
[ "$device" = cpu ] || nvidia-smi -L
status=0
smoke() {  # config, images, label, results dir of the config
    timeout "${BUDGET_S:-180}" python3 scripts/run.py "$1" --quiet --fresh --set device="$device" \
        --set dataset.n="$2" 2>&1 | tee "$out/smoke_$3.log" | tail -20
    local rc=${PIPESTATUS[0]}
    echo "smoke $3: exit $rc"
    [ "$rc" = 0 ] || status=1
    cp "$4/leaderboard.csv" "$out/leaderboard_$3.csv" 2>/dev/null
}
smoke configs/cifar10_query_all.yaml "${N_SMOKE:-4}" query results/cifar10_all
smoke configs/cifar10_transfer.yaml "${N_SMOKE_T:-16}" transfer results/cifar10_transfer
timeout "${BUDGET_BENCH_S:-240}" python3 benchmarks/compare_peers.py --only seeds --seeds "${SEEDS:-3}" \
    --n "${N:-100}" --n-hsja "${N_HSJA:-10}" --device "$device" --eps 8/255 --out "$out/RESULTS_device.md" \
    2>&1 | tee "$out/seeds.log" | grep -v '^| .* seed [0-9]* |'
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
