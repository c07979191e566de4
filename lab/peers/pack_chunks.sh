#!/usr/bin/env bash
# pack_chunks.sh PAYLOAD DEST NAME — one tar of PAYLOAD (wheels, MANIFEST), cut into device-call
# chunks: DEST/chunkNN/NAME.tar.NN of at most CHUNK_MIB MiB (default 48: a device call copies
# the repository tree, ~12 MiB, plus the carried folders, 64 MiB in all) and in each chunk
# KIT_SHA256 ("sha256-of-the-tar number-of-parts"). unpack_chunks.sh joins and checks them.
set -euo pipefail
PAYLOAD=${1:?usage: pack_chunks.sh PAYLOAD DEST NAME} DEST=${2:?} NAME=${3:?}
mib=${CHUNK_MIB:-48}
part=$(( mib * 1024 * 1024 ))
tar --sort=name --mtime=2026-01-01 --owner=0 --group=0 --numeric-owner -C "$PAYLOAD" \
    -cf "$DEST/$NAME.tar" .
sum=$(sha256sum "$DEST/$NAME.tar" | cut -d' ' -f1)
size=$(stat -c %s "$DEST/$NAME.tar")
parts=$(( (size + part - 1) / part ))
rm -rf "$DEST"/chunk[0-9][0-9]
for i in $(seq 0 $((parts - 1))); do
  c=$(printf '%s/chunk%02d' "$DEST" "$i"); mkdir -p "$c"
  # (dd, not tail | head: under pipefail head's early exit kills tail with SIGPIPE)
  dd if="$DEST/$NAME.tar" of="$c/$NAME.tar.$(printf %02d "$i")" bs=1M skip=$((i * mib)) \
     count="$mib" status=none
  echo "$sum $parts" > "$c/KIT_SHA256"
done
joined=$(cat "$DEST"/chunk[0-9][0-9]/"$NAME".tar.[0-9][0-9] | sha256sum | cut -d' ' -f1)
[ "$joined" = "$sum" ] || { echo "pack_chunks.sh: the parts do not join back" >&2; exit 1; }
for c in "$DEST"/chunk[0-9][0-9]; do
  printf '%s  %5.1f MiB\n' "$c" "$(du -sb "$c" | awk '{print $1 / 1048576}')"
done
echo "== $NAME.tar $(awk -v s="$size" 'BEGIN {printf "%.1f", s / 1048576}') MiB in $parts chunks, sha256 $sum"
