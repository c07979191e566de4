#!/usr/bin/env bash
# vLLM 0.26.0 on the GPU machine, beside the 0.25.1 baseline kit (issue 57). Runs from the
# repository root there.
#   stage DIR   add a chunk folder of fetch.sh (chunkNN) to $V026_TMP/stage
#   install     join and check the parts, pip install --no-deps into $V026_TMP/site, the model
#               folder into $V026_TMP/model (from .baseline-kit/model), import check
# Then the 0.25.1 kit serves and benchmarks it unchanged, pointed at this install:
#   BASELINE_TMP=$V026_TMP bash .baseline-kit/remote.sh --port 8003 serve fp8
# (lab/peers.sh does so for the engine `vllm026`). V026_TMP defaults to /tmp/v026.
set -euo pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$KIT/../../.." && pwd)
T=${V026_TMP:-/tmp/v026}
die() { echo "remote.sh: $*" >&2; exit 1; }
case "${1:-}" in
stage)
  [ -d "${2:-}" ] || die "stage: no folder ${2:-} (carry it)"
  mkdir -p "$T/stage" && cp -r "$2"/. "$T/stage/" && ls -la "$T/stage" ;;
install)
  bash "$KIT/../unpack_chunks.sh" "$T/stage" vllm026-kit "$T/stage/kit"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$T/site" "$T"/stage/kit/*.whl
  src=${MODEL_SRC:-$ROOT/.baseline-kit/model}
  [ -f "$src/config.json" ] || die "no $src/config.json: carry .baseline-kit"
  rm -rf "$T/model" && cp -r "$src" "$T/model"
  python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" \
      "$T/model/tokenizer.json.xz" "$T/model/tokenizer.json" && rm -f "$T/model/tokenizer.json.xz"
  PYTHONPATH=$T/site python3 -c 'import vllm, vllm._C_stable_libtorch, vllm._moe_C_stable_libtorch
import vllm.entrypoints.openai.api_server
print("vllm", vllm.__version__)'
  du -sh "$T/site" ;;
*) sed -n '2,10p' "$0"; exit 1 ;;
esac
