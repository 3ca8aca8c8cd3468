#!/usr/bin/env bash
# Put a packed JIT cache beside a bundle's parts, as an extra part set (make-bundle.sh
# --jit-cache; on its own it needs no network):
#
#   tools/offline-bundle/add-jit-cache.sh PACK_DIR OUT_DIR VLLM_VERSION
#
# PACK_DIR is what `python -m harness warmup --pack PACK_DIR` wrote on a warmed GPU host of
# the architecture the bundle is for (part.NN, SHA256SUMS, MANIFEST with the key). Checked
# first (verify.sh: every part present and matching SHA256SUMS), and its MANIFEST must be a
# JIT cache's packed with vLLM VLLM_VERSION: a pack of another release would never be used.
# Copied to OUT_DIR/jit-cache/ (an old one there is replaced); install.sh restores it.
# OUT_DIR `-`: the checks only.
# One line and exit 1 when refused.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ $# -eq 3 ] || die "usage: add-jit-cache.sh PACK_DIR OUT_DIR VLLM_VERSION"
pack=$1 out=$2 version=$3
field() { [ -f "$1" ] && sed -n "s/^$2=//p" "$1" | head -n 1; }   # MANIFEST KEY -> value
[ -d "$pack" ] || die "--jit-cache $pack: no such folder (python -m harness warmup --pack writes one)"
[ "$(field "$pack/MANIFEST" kind)" = hyv4-jit-cache ] ||
  die "--jit-cache $pack: $pack/MANIFEST is not a packed JIT cache's (python -m harness warmup --pack writes one)"
packed=$(field "$pack/MANIFEST" vllm)
[ "$packed" = "$version" ] ||
  die "--jit-cache $pack: packed with vLLM $packed, the bundle is vLLM $version (pack it on a host running $version)"
"$HERE/verify.sh" "$pack" >/dev/null || exit 1
[ "$out" != - ] || exit 0
mkdir -p "$out" || die "cannot create $out"
rm -rf "$out/jit-cache.tmp" && mkdir "$out/jit-cache.tmp" || die "cannot write in $out"
cp "$pack"/part.* "$pack/SHA256SUMS" "$pack/MANIFEST" "$out/jit-cache.tmp/" || { rm -rf "$out/jit-cache.tmp"; die "cannot copy $pack"; }
rm -rf "$out/jit-cache" && mv "$out/jit-cache.tmp" "$out/jit-cache" || die "cannot move the pack to $out/jit-cache"
n=$(grep -c . "$out/jit-cache/SHA256SUMS")
echo "offline-bundle: packed JIT cache added as $out/jit-cache ($n parts, vLLM $version, compute capability $(field "$pack/MANIFEST" capability))"
