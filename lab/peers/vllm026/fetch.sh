#!/usr/bin/env bash
# fetch.sh DEST — vLLM 0.26.0 (the newest vLLM on torch 2.11) beside the 0.25.1 kit: the wheels
# of wheels.lock, the vllm wheel slimmed for sm_90 by the baseline kit's make_slim_vllm_wheel.py
# --lzma (same files dropped: FA2, DeepGEMM, FlashMLA, Blackwell kernels, Rust frontend), one
# tar cut into DEST/chunkNN (../pack_chunks.sh). On the GPU machine: remote.sh stage each chunk,
# remote.sh install; the 0.25.1 kit's remote.sh serves it (BASELINE_TMP=/tmp/v026).
# Environment: PYTHON, INDEX_URL, CHUNK_MIB, SLIM (the slimming script; default
# .baseline-kit/make_slim_vllm_wheel.py, else ../shared/baseline/make_slim_vllm_wheel.py).
set -euo pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$KIT/../../.." && pwd)
DEST=${1:?usage: fetch.sh DEST}
PY=${PYTHON:-python3}
LOCK=$KIT/wheels.lock
WHEEL=vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl
die() { echo "fetch.sh: $*" >&2; exit 1; }
SLIM=${SLIM:-}
for s in "$ROOT/.baseline-kit/make_slim_vllm_wheel.py" "$ROOT/../shared/baseline/make_slim_vllm_wheel.py"; do
  [ -z "$SLIM" ] && [ -f "$s" ] && SLIM=$s
done
[ -f "$SLIM" ] || die "no make_slim_vllm_wheel.py: cp -r ../shared/baseline .baseline-kit, or set SLIM"
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)

idx=(); [ -n "${INDEX_URL:-}" ] && idx=(--index-url "$INDEX_URL")
plat=(); for y in $(seq 31 -1 5); do plat+=(--platform "manylinux_2_${y}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_NO_INDEX \
    -u PIP_REQUIRE_VIRTUALENV PIP_CONFIG_FILE=/dev/null \
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 "${plat[@]}" "${idx[@]}" \
    --require-hashes -r "$LOCK" -d "$DEST/pypi"

rm -rf "$DEST/payload" && mkdir -p "$DEST/payload" && : > "$DEST/payload/MANIFEST"
while read -r spec hash _ file; do
  case "$spec" in ''|'#'*) continue ;; esac
  [ -f "$DEST/pypi/$file" ] || die "missing $file"
  [ "--hash=sha256:$(sha256sum "$DEST/pypi/$file" | cut -d' ' -f1)" = "$hash" ] || die "sha256 mismatch: $file"
  if [ "$file" = "$WHEEL" ]; then
    echo "== $SLIM --lzma (a few minutes)"
    rm -rf "$DEST/slim" && "$PY" "$SLIM" "$DEST/pypi/$file" "$DEST/slim" --lzma
    cp "$DEST/slim/$file" "$DEST/payload/"
  else
    cp "$DEST/pypi/$file" "$DEST/payload/"
  fi
  echo "always $file $(sha256sum "$DEST/payload/$file" | cut -d' ' -f1)" >> "$DEST/payload/MANIFEST"
done < "$LOCK"
bash "$KIT/../pack_chunks.sh" "$DEST/payload" "$DEST" vllm026-kit
