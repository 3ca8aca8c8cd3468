#!/usr/bin/env bash
# make-bundle.sh's strip step (no network): tar an unzipped vLLM wheel's
# `vllm/` and `vllm-*.dist-info/` without what strip.txt lists, xz-compressed.
#
#   tools/offline-bundle/strip.sh UNZIPPED_WHEEL_DIR OUT.tar.xz
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "strip: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: strip.sh UNZIPPED_WHEEL_DIR OUT.tar.xz"
src=$1 out=$2
[ -d "$src/vllm" ] || die "$src/vllm is missing: not an unzipped vLLM wheel"
excludes=$(mktemp)
trap 'rm -f "$excludes" "$out.tmp"' EXIT
sed -e 's/#.*//' -e 's/[[:space:]]*$//' -e '/^$/d' "$HERE/strip.txt" > "$excludes"
# xz -9 (64 MiB dictionary): 0.4 MB smaller than -6 on vLLM 0.34.0, enough to
# matter where a bundle ends just past a part boundary.
(cd "$src" && tar --exclude-from="$excludes" -cf - vllm vllm-*.dist-info) | xz -T0 -9 > "$out.tmp"
mv "$out.tmp" "$out"
echo "stripped $(wc -l < "$excludes") patterns (strip.txt): $(du -h "$out" | cut -f1) $out"
