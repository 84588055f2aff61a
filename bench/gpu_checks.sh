#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run, each step bounded in time so that one
# that hangs leaves the others their turn:
#   cuda-tests      tests/test_cuda.py and the Triton kernels compiled
#                   (tests/attention/test_triton.py, tests/model/test_add_norm.py)
#   step-products   the base model's step products each timed alone
#                   (bench/step_products.py: the MFU they allow, padded batches with
#                   SDPA and packed rows with the Triton kernel)
#   train-cuda      the base model's training throughput: padded and compiled, and
#                   packed, compiled and replayed as CUDA graphs, with the Triton
#                   add-norm kernels and without (bench/train_cuda.py)
#   train-loop      `transduce train`'s own loop, the next batch made during each step
#                   against it made after the wait (bench/train_loop.py)
#   autotune        (on request only) the graphed packed step against the same compiled
#                   with mode="max-autotune"
# Run from the repository root, in an environment with a CUDA build of torch, Triton
# and the test extra, with the Bible corpus and its vocabulary in data/bible (`make
# demo` makes them; copy them over if the GPU machine has no SWORD):
#
#     bash bench/gpu_checks.sh [output directory] [cuda-tests] [step-products] [train-cuda] \
#         [train-loop] [autotune]
#
# The output directory defaults to bench/results/gpu-checks, the steps to the first four
# (about 2, 1, 6 and 3 minutes: name some to split the run; autotune takes up to 9).
# Logs and the benchmarks' JSON land in the output directory; the exit status is the
# first failing step's.
set -u
out=${1:-bench/results/gpu-checks}
shift $(( $# > 0 ? 1 : 0 ))
wanted=${*:-cuda-tests step-products train-cuda train-loop}
for name in $wanted; do
    case $name in
        cuda-tests|step-products|train-cuda|train-loop|autotune) ;;
        *) echo "unknown step '$name': choose cuda-tests, step-products, train-cuda," \
                "train-loop or autotune" >&2
           exit 2 ;;
    esac
done
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
status=0

step() {   # step NAME SECONDS COMMAND...: runs COMMAND into $out/NAME.log, if wanted
    local name=$1 seconds=$2
    shift 2
    case " $wanted " in *" ${name%%:*} "*) ;; *) return 0 ;; esac
    name=${name/:/-}
    local started=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    local code=$?
    echo "$name: exit $code after $((SECONDS - started)) s (log: $out/$name.log)"
    if [ "$status" -eq 0 ]; then status=$code; fi
}

if ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; then
    echo "no NVIDIA GPU answers here (nvidia-smi failed): nothing to check" >&2
    exit 1
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
step cuda-tests 240 python3 -m pytest -q -p no:cacheprovider -n 8 \
    tests/test_cuda.py tests/attention/test_triton.py tests/model/test_add_norm.py
step step-products:padded 60 python3 bench/step_products.py --device cuda \
    --data data/bible --max-tokens 25000 --out "$out/step-products-padded.json"
step step-products:packed 60 python3 bench/step_products.py --device cuda \
    --data data/bible --max-tokens 25000 --pack-length 256 --impl triton \
    --out "$out/step-products-packed.json"
step train-cuda 420 python3 bench/train.py --device cuda --data data/bible \
    --max-tokens 25000 --steps 10 --profile --out "$out/train-cuda-packed.json" \
    --peers "ours sdpa compiled" "ours triton packed graphed" \
    "ours triton unfused packed graphed"
step train-loop 300 python3 bench/train_loop.py --data data/bible --preset base \
    --max-tokens 25000 --pack-length 256 --impl triton --compile --cuda-graphs \
    --dtype bfloat16 --rounds 4 --steps 10 --out "$out/train-loop.json"
step autotune 540 python3 bench/train.py --device cuda --data data/bible \
    --max-tokens 25000 --steps 10 --profile --out "$out/train-cuda-autotuned.json" \
    --peers "ours triton packed graphed" "ours triton packed autotuned"
[ -f "$out/cuda-tests.log" ] && grep -E "passed|failed" "$out/cuda-tests.log" | tail -1
for log in "$out"/step-products-*.log; do [ -f "$log" ] && grep -A2 "^products alone" "$log"; done
[ -f "$out/train-cuda.log" ] && sed -n '/^peer /,/^=====/p' "$out/train-cuda.log" | grep -v "^====="
for log in "$out"/train-cuda.log "$out"/autotune.log; do
    [ -f "$log" ] && grep -E "^(ours|=====|GPU ms per step)" "$log"
done
[ -f "$out/train-loop.log" ] && tail -3 "$out/train-loop.log"
exit $status
