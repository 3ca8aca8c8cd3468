#!/usr/bin/env bash
# Pack a staged bundle into shippable parts (make-bundle.sh's last step; on its
# own it needs no network):
#
#   tools/offline-bundle/pack.sh STAGE_DIR OUT_DIR [PART_BYTES]
#
# STAGE_DIR holds bundle/ (vllm.tar.xz, deps.tar.xz or deps/*.whl, install.sh,
# MANIFEST). Writes OUT_DIR/part.00, part.01, ... (a tar of bundle/, split at
# PART_BYTES, default 60000000), OUT_DIR/SHA256SUMS (sha256sum format, one line
# a part) and a copy of bundle/MANIFEST as OUT_DIR/MANIFEST (it travels with
# the parts: install.sh reads a delta's base from it before unpacking).
# Old parts in OUT_DIR are removed first.
set -euo pipefail
die() { echo "pack: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: pack.sh STAGE_DIR OUT_DIR [PART_BYTES]"
STAGE=$1 OUT=$2 PART=${3:-60000000}
[[ $PART =~ ^[1-9][0-9]*$ ]] || die "PART_BYTES must be a positive number of bytes, got '$PART'"
[ -f "$STAGE/bundle/vllm.tar.xz" ] || die "$STAGE/bundle/vllm.tar.xz is missing: not a staged bundle"
mkdir -p "$OUT"
rm -f "$OUT"/part.* "$OUT/SHA256SUMS" "$OUT/MANIFEST"
# -a 2: part.00 .. part.99 (split refuses beyond, rather than renumbering).
(cd "$STAGE" && tar -cf - bundle) | split -a 2 -d -b "$PART" - "$OUT/part."
(cd "$OUT" && sha256sum part.* > SHA256SUMS.tmp && mv SHA256SUMS.tmp SHA256SUMS)
if [ -f "$STAGE/bundle/MANIFEST" ]; then cp "$STAGE/bundle/MANIFEST" "$OUT/MANIFEST"; fi
ls -l "$OUT"
echo "ship every $OUT/part.*, $OUT/SHA256SUMS and $OUT/MANIFEST to one folder on the GPU host; there, from the repo root:"
echo "  tools/offline-bundle/install.sh PARTS_DIR        # then run with PATH=/tmp/vllm-VERSION/bin:\$PATH"
