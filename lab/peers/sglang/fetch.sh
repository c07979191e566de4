#!/usr/bin/env bash
# fetch.sh DEST — the SGLang 0.5.17 kit's wheels, slimmed and cut into device-call chunks.
#
# Runs on any Linux machine that reaches PyPI (no GPU). It
#   1. downloads with pip the exact wheels of wheels.lock (every file checked against its
#      sha256 there) into DEST/pypi,
#   2. repacks sglang-kernel for sm_90 (slim_sglang_kernel.py; SLIM_LZMA=0: deflate members,
#      DROP_FA3=1: without FlashAttention 3) into DEST/slim,
#   3. packs every wheel to install (the slim sglang-kernel for the PyPI one) with MANIFEST
#      (group, file, sha256) into DEST/sglang-kit.tar and cuts it into DEST/chunkNN/ folders of
#      at most CHUNK_MIB MiB (../pack_chunks.sh; default 48: a device call copies the repository
#      tree, ~12 MiB, plus the carried folders, 64 MiB in all); each chunk holds KIT_SHA256.
# On the GPU machine: remote.sh stage DEST/chunkNN (one call each), then remote.sh install.
#
# Environment: PYTHON (default python3), INDEX_URL (default: pip's own default index),
# CHUNK_MIB, SLIM_LZMA, DROP_FA3.
set -euo pipefail

KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEST=${1:?usage: fetch.sh DEST}
PY=${PYTHON:-python3}
LOCK=$KIT/wheels.lock
die() { echo "fetch.sh: $*" >&2; exit 1; }
command -v sha256sum >/dev/null || die "needs sha256sum (coreutils)"
mkdir -p "$DEST" && DEST=$(cd "$DEST" && pwd)

# 1. Download: only INDEX_URL (or pip's default index); local pip settings are ignored.
idx=(); [ -n "${INDEX_URL:-}" ] && idx=(--index-url "$INDEX_URL")
plat=(); for y in $(seq 39 -1 5); do plat+=(--platform "manylinux_2_${y}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
echo "== pip download -> $DEST/pypi"
env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_NO_INDEX \
    -u PIP_REQUIRE_VIRTUALENV PIP_CONFIG_FILE=/dev/null \
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 "${plat[@]}" "${idx[@]}" \
    --require-hashes -r "$LOCK" -d "$DEST/pypi"

# The lock's lines: SPEC HASH # GROUP FILE
rm -rf "$DEST/payload" && mkdir -p "$DEST/payload"
: > "$DEST/payload/MANIFEST"
n=0
while read -r spec hash _ group file; do
  case "$spec" in ''|'#'*) continue ;; esac
  [ -f "$DEST/pypi/$file" ] || die "missing $file in $DEST/pypi"
  got=$(sha256sum "$DEST/pypi/$file" | cut -d' ' -f1)
  [ "--hash=sha256:$got" = "$hash" ] || die "sha256 mismatch for $file"
  n=$((n + 1))
  if [ "$group" = slim ]; then
    # 2. sm_90 only
    rm -rf "$DEST/slim"
    args=(); [ "${SLIM_LZMA:-1}" = 1 ] && args+=(--lzma); [ "${DROP_FA3:-0}" = 1 ] && args+=(--drop-fa3)
    echo "== slim_sglang_kernel.py ${args[*]} (about 10 minutes: LZMA over 500 MiB of cubins)"
    "$PY" "$KIT/slim_sglang_kernel.py" "$DEST/pypi/$file" "$DEST/slim" "${args[@]}"
    cp "$DEST/slim/$file" "$DEST/payload/"
    group=always
  else
    cp "$DEST/pypi/$file" "$DEST/payload/"
  fi
  echo "$group $file $(sha256sum "$DEST/payload/$file" | cut -d' ' -f1)" >> "$DEST/payload/MANIFEST"
done < "$LOCK"
echo "== $n wheels as pinned; payload $(du -sm "$DEST/payload" | cut -f1) MiB"

# 3. One tar (wheels are compressed already), cut into chunks.
bash "$KIT/../pack_chunks.sh" "$DEST/payload" "$DEST" sglang-kit
