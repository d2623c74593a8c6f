#!/usr/bin/env bash
# The CUDA check in one call: build, the suite's CUDA cases, then the GPU benchmarks.
#
#   bash bench/gpu_check.sh [compile|tests|bench|all] [OUTDIR]
#
# "compile" needs no GPU: every triton kernel compiled for sm_90 (one line per kernel, exit 1 on a failure).
#
# Runs from the repository root with the machine's own python3 (its torch must see a GPU).
# "tests": every test whose id names cuda (the `device` fixture's cuda case, tests/bench's CUDA bounds and
# tests/unit/test_cuda_end_to_end.py); "suite": the rest of the suite with xdist (in "all" only when SUITE_S
# is set); "bench": bench/ops.py, bench/lookup.py (and its batch-65536 d128 case), bench/lookup_profile.py,
# bench/train.py and bench/step_profile.py on cuda. Logs go to OUTDIR (default ./gpu-check).
# "all" stays under ~9 minutes (an H100 on 2026-11-28: build ~75 s, CUDA tests ~80 s, benchmarks ~4 min;
# each part has a timeout: CUDA_TESTS_S, SUITE_S, OPS_S, LOOKUP_S, BIG_S, LPROF_S, TRAIN_S, PROFILE_S;
# OPS_S=0, LOOKUP_S=0 or LPROF_S=0 leaves that one out), one call of a 15-minute device budget:
# `bash bench/gpu_check.sh all $OUT`.
set -uo pipefail
what=${1:-all}
out=${2:-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if [[ $what == compile ]]; then
    TRITON_INTERPRET=0 exec python3 -m hugeembed._triton.compile_check ${ARCH:-90}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name())"
# the kernels are plain C++ called through ctypes: a library built elsewhere (carried) loads as it is
if python3 -c "import hugeembed._native as n; n.lib()" 2>/dev/null; then echo "native kernels load: no build"
else python3 setup.py build_ext --inplace -q >/tmp/hugeembed-build.log 2>&1 || { echo "native build failed"; tail -20 /tmp/hugeembed-build.log; }; fi
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")

if [[ $what == all ]]; then
    echo "== triton kernels compiled for sm_90"
    TRITON_INTERPRET=0 python3 -m hugeembed._triton.compile_check 90 2>&1 | tee "$out/compile.log" | tail -30
fi
if [[ $what == tests || $what == all ]]; then
    echo "== CUDA cases"
    # -v: a run cut short by the timeout still shows each result
    timeout ${CUDA_TESTS_S:-150} python3 -m pytest -v -p no:cacheprovider -p no:benchmark $xdist -k cuda tests/unit tests/bench \
        -o addopts="-ra" >"$out/cuda_tests.log" 2>&1
    echo "rc $?"; grep -E "(passed|failed).* in " "$out/cuda_tests.log" | tail -2
    grep -E "(FAILED|ERROR) " "$out/cuda_tests.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort -u | head -60
fi
if [[ $what == suite || ( $what == all && -n ${SUITE_S:-} ) ]]; then  # (in "all" only when SUITE_S is set)
    echo "== whole suite (CUDA visible: device=auto picks it)"
    timeout ${SUITE_S:-120} python3 -m pytest -v -p no:cacheprovider -p no:benchmark $xdist tests -o addopts="-ra" \
        -k "not cuda" >"$out/suite.log" 2>&1
    echo "rc $?"; grep -E "(passed|failed).* in " "$out/suite.log" | tail -2
    grep -E "(FAILED|ERROR) " "$out/suite.log" | sed 's/^\[gw[0-9]*\] *\[ *[0-9]*%\] *//' | sort -u | head -80
fi
if [[ $what == bench || $what == all ]]; then
    [[ ${OPS_S:-60} == 0 ]] || echo "== bench/ops.py"
    [[ ${OPS_S:-60} == 0 ]] || timeout ${OPS_S:-60} python3 bench/ops.py --device cuda ${OPS_ARGS:---tables 2 8 32 --time-samples 8192} 2>&1 | tee "$out/ops.log" | tail -16
    if [[ ${LOOKUP_S:-90} != 0 ]]; then
        echo "== bench/lookup.py"
        timeout ${LOOKUP_S:-90} python3 bench/lookup.py --device cuda \
            ${LOOKUP_ARGS:---dims 16 64 --runs 3 --seconds 0.3 --impls ours coll ebag} 2>&1 \
            | tee "$out/lookup.log" | grep -v "^#" | tail -16
        # issue 32's bandwidth case: bytes that must move / time (forward 26 x 65536 x 20 rows of 512 B read)
        echo "== bench/lookup.py, batch 65536, d128, pooling 20"
        timeout ${BIG_S:-60} python3 bench/lookup.py --device cuda --batch 65536 --dims 128 --pooling 20 --runs 3 \
            --seconds 0.3 --impls coll ebag 2>&1 | tee "$out/lookup_big.log" | grep -v "^#" | tail -4
    fi
    if [[ ${LPROF_S:-40} != 0 ]]; then
        echo "== bench/lookup_profile.py (kernels and host Python per step: $out/lookup_profile.log)"
        timeout ${LPROF_S:-40} python3 bench/lookup_profile.py --device cuda --dim 16 --pooling 1 --impls coll ebag \
            >"$out/lookup_profile.log" 2>&1
        grep -E "^## |device time" "$out/lookup_profile.log"
    fi
    echo "== bench/train.py"
    timeout ${TRAIN_S:-60} python3 bench/train.py --device cuda --cases ${TRAIN_CASES:-dense ours-mem ebag} \
        --runs 3 --iters 10 --warmup-batches 10 ${TRAIN_ARGS:---dims 16 --batches 8192} 2>&1 | tee "$out/train.log" | tail -8
    echo "== bench/step_profile.py"
    for kind in --static ""; do
        timeout ${PROFILE_S:-30} python3 bench/step_profile.py --device cuda $kind --top 15 >"$out/profile$kind.log" 2>&1
        grep -E "^(#|step|embeddings)" "$out/profile$kind.log"
    done
fi
