#!/usr/bin/env bash
# One pass of every GPU check and timing, in priority order, each step under its own time limit:
# the users' configuration (bf16 / fp16 weights and KV, pages of 16-128, CUDA graphs) through
# `hal demo` and `hal generate` with MTP, then `hal bench` against the plain decoder, then the
# native conformance and kernel timings of benchmarks/cuda_check.py.
#
#     bash benchmarks/cuda_session.sh [OUT_DIR]      # on a machine with an NVIDIA GPU and hal installed
#
# Logs go to OUT_DIR/log (default ./cuda-session); the bench tables to OUT_DIR/bench/.
# On a cold machine the first steps are dominated by Triton compiling the kernel's variants (a few
# seconds each, one per tile shape, head layout and dtype); later steps reuse ~/.triton/cache. The
# whole pass needs about 20 minutes on a cold machine.
set -uo pipefail
out=${1:-cuda-session}
mkdir -p "$out"
unset TRITON_INTERPRET
failed=()
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start))s"
    [ $rc -eq 0 ] || failed+=("$name (exit $rc)")
}
{
    nvidia-smi -L
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    hal info
    step "demo bf16, default pages" 300 hal demo --device cuda
    step "export" 120 hal demo --device cuda --max-new-tokens 4 --export "$out/ckpt"
    for s in 1 3; do
        step "generate MTP S=$s, bf16, pages of 16" 45 hal generate --model "$out/ckpt" --device cuda \
            --prompt-ids 5,6,7,8,9,10,11 --max-new-tokens 24 --speculative mtp --num-draft-steps $s --page-size 16 --json
    done
    step "generate greedy, bf16, pages of 16" 45 hal generate --model "$out/ckpt" --device cuda \
        --prompt-ids 5,6,7,8,9,10,11 --max-new-tokens 24 --page-size 16 --json
    rm -rf "$out/ckpt"
    step "bench" 400 hal bench --device cuda --speculative --plain --out "$out/bench"
    step "cuda_check" 400 python3 benchmarks/cuda_check.py
    step "demo bf16, pages of 16" 60 hal demo --device cuda --page-size 16
    step "demo fp16, pages of 128" 60 hal demo --device cuda --dtype float16 --page-size 128
    step "demo float32 weights, bf16 KV" 60 hal demo --device cuda --dtype float32 --kv-dtype bfloat16
    echo "failed steps: ${failed[*]:-none}"
} 2>&1 | tee "$out/log"
