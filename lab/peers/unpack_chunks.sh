#!/usr/bin/env bash
# unpack_chunks.sh STAGE NAME OUTDIR — on the GPU machine: join the staged parts of NAME.tar
# (pack_chunks.sh), check them against KIT_SHA256, unpack into OUTDIR and check every file
# against OUTDIR/MANIFEST ("group file sha256" lines).
set -euo pipefail
STAGE=${1:?usage: unpack_chunks.sh STAGE NAME OUTDIR} NAME=${2:?} OUT=${3:?}
die() { echo "unpack_chunks.sh: $*" >&2; exit 1; }
[ -f "$STAGE/KIT_SHA256" ] || die "no $STAGE/KIT_SHA256: stage the chunks of one fetch run"
read -r want parts < "$STAGE/KIT_SHA256"
have=$(ls "$STAGE/$NAME".tar.[0-9][0-9] 2>/dev/null | wc -l)
[ "$have" = "$parts" ] || die "$have of $parts parts staged: stage every chunkNN"
cat "$STAGE/$NAME".tar.[0-9][0-9] > "$STAGE/$NAME.tar"
got=$(sha256sum "$STAGE/$NAME.tar" | cut -d' ' -f1)
[ "$got" = "$want" ] || die "joined tar sha256 $got, expected $want"
rm -rf "$OUT" && mkdir -p "$OUT" && tar -xf "$STAGE/$NAME.tar" -C "$OUT" && rm -f "$STAGE/$NAME.tar"
while read -r _ file sum; do
  [ "$(sha256sum "$OUT/$file" | cut -d' ' -f1)" = "$sum" ] || die "sha256 mismatch: $file"
done < "$OUT/MANIFEST"
echo "unpacked $(wc -l < "$OUT/MANIFEST") files of $NAME.tar, every sha256 as packed"
