#!/usr/bin/env bash
# Build FlashAttention-3's Hopper forward kernel for this model's shape (bf16, head dim 256,
# causal or not, one sequence a call; keys strided or in the KV cache's pages) into .fa3/libtailored_fa3.so, with tailored's C entry
# point (tailored/kernels/fa3_entry.cu) and no torch headers: the library loads through ctypes
# under any torch (tailored/kernels/fa3.py; docs/prefill-attention.md). .fa3/ is git-ignored:
# carry it to the GPU machine (`carry: [".fa3"]`); the server finds it there (TAILORED_FA3_LIB
# only for a build elsewhere).
#
# Needs nvcc >= 12.3 (13.0 here and on the GPU machines), flash-attention's sources at FA_COMMIT
# and CUTLASS at the commit flash-attention pins (csrc/cutlass). Either give their checkouts
# (FA_SRC=<flash-attention checkout> CUTLASS_SRC=<cutlass checkout>), or put them in .fa3/src/
# (flash-attention/, cutlass/), or, where `git` can reach them, let the script clone them there.
# Usage: bash lab/build_fa3.sh            (JOBS=N parallel nvcc processes, default: cores)
set -euo pipefail
cd "$(dirname "$0")/.."
FA_COMMIT=0251105a  # flash-attention main, 2026-12 (the hopper/ sources read for fa3_entry.cu)
CUTLASS_COMMIT=7127592069c2fe01b041e174ba4345ef9b279671  # flash-attention's csrc/cutlass pin
OUT=.fa3
mkdir -p "$OUT/obj"
# a source tree already under .fa3/src (a git checkout, or the files copied there to travel
# with .fa3 to a machine without network) is used as it is
fetch() {  # fetch DIR URL COMMIT NAME
    [ -d "$1" ] && return 0
    if ! git clone -q "$2" "$1" || ! git -C "$1" checkout -q "$3"; then
        rm -rf "$1"
        echo "build_fa3.sh: could not clone $4 at $3 from $2; give a checkout of it as" \
             "${4^^}_SRC=<dir> (or put one at $1)" >&2
        exit 1
    fi
}
if [ -z "${FA_SRC:-}" ]; then
    FA_SRC=$OUT/src/flash-attention
    fetch "$FA_SRC" https://github.com/Dao-AILab/flash-attention "$FA_COMMIT" fa
fi
if [ -z "${CUTLASS_SRC:-}" ]; then
    CUTLASS_SRC=$OUT/src/cutlass
    fetch "$CUTLASS_SRC" https://github.com/NVIDIA/cutlass "$CUTLASS_COMMIT" cutlass
fi
[ -f "$FA_SRC/hopper/flash.h" ] || { echo "build_fa3.sh: no hopper/flash.h under FA_SRC=$FA_SRC" >&2; exit 1; }
[ -d "$CUTLASS_SRC/include/cute" ] || { echo "build_fa3.sh: no include/cute under CUTLASS_SRC=$CUTLASS_SRC" >&2; exit 1; }
command -v nvcc > /dev/null || { echo "build_fa3.sh: nvcc not found (CUDA >= 12.3)" >&2; exit 1; }
H=$FA_SRC/hopper
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
# Everything this model never asks for is compiled out: backward, fp16/fp8, the other head
# dims, split-KV, local windows, softcap, appended KV, clusters, sm8x. Kept: paged keys with
# device lengths and packed GQA (a chunk over its cached context inside a CUDA graph).
FEATURES="-DFLASHATTENTION_DISABLE_BACKWARD -DFLASHATTENTION_DISABLE_FP16 -DFLASHATTENTION_DISABLE_FP8
 -DFLASHATTENTION_DISABLE_HDIM64 -DFLASHATTENTION_DISABLE_HDIM96 -DFLASHATTENTION_DISABLE_HDIM128
 -DFLASHATTENTION_DISABLE_HDIM192 -DFLASHATTENTION_DISABLE_HDIMDIFF64 -DFLASHATTENTION_DISABLE_HDIMDIFF192
 -DFLASHATTENTION_DISABLE_SPLIT -DFLASHATTENTION_DISABLE_LOCAL -DFLASHATTENTION_DISABLE_SOFTCAP
 -DFLASHATTENTION_DISABLE_APPENDKV -DFLASHATTENTION_DISABLE_CLUSTER -DFLASHATTENTION_DISABLE_SM8x"
# flash-attention's own release flags (hopper/setup.py) and the ones torch's extension builder
# adds to every CUDA file (torch.utils.cpp_extension.COMMON_NVCC_FLAGS), for sm_90a only; every
# symbol hidden but the two entry points (another FlashAttention build in the process keeps its own)
FLAGS="-O3 -std=c++17 --use_fast_math --expt-relaxed-constexpr -diag-suppress 20013
 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
 -D__CUDA_NO_HALF2_OPERATORS__ -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
 -DCUTLASS_ENABLE_GDC_FOR_SM90 -DCUTLASS_DEBUG_TRACE_LEVEL=0 -DNDEBUG
 -gencode=arch=compute_90a,code=sm_90a -Xcompiler -fPIC -Xcompiler -fvisibility=hidden
 -I$H -I$CUTLASS_SRC/include -I$CUDA_HOME/include/cccl"
SOURCES="$H/instantiations/flash_fwd_hdim256_bf16_sm90.cu
 $H/instantiations/flash_fwd_hdim256_bf16_paged_sm90.cu $H/flash_prepare_scheduler.cu
 tailored/kernels/fa3_entry.cu"
pids=()
for s in $SOURCES; do
    o=$OUT/obj/$(basename "$s" .cu).o
    # shellcheck disable=SC2086
    nvcc $FLAGS $FEATURES -c "$s" -o "$o" &
    pids+=($!)
    while [ "$(jobs -rp | wc -l)" -ge "${JOBS:-$(nproc)}" ]; do sleep 1; done
done
for p in "${pids[@]}"; do wait "$p"; done
nvcc -shared -gencode=arch=compute_90a,code=sm_90a -o "$OUT/libtailored_fa3.so" "$OUT"/obj/*.o
{
    rev() { if [ -e "$1/.git" ]; then git -C "$1" rev-parse HEAD; else echo "$2 (a copied tree)"; fi; }
    echo "flash-attention $(rev "$FA_SRC" "$FA_COMMIT")"
    echo "cutlass $(rev "$CUTLASS_SRC" "$CUTLASS_COMMIT")"
    nvcc --version | tail -1
} > "$OUT/BUILD"
ls -l "$OUT/libtailored_fa3.so"
