#!/usr/bin/env bash
# On the GPU host, from the repo root: verify the shipped parts, unpack them
# into the bundle store and install vLLM and the bundled wheels into ENV_DIR,
# a virtual environment on the host's Python (bundle-install.sh):
#
#   tools/offline-bundle/install.sh PARTS_DIR [ENV_DIR]   # ENV_DIR default /tmp/vllm-VERSION
#   PATH=ENV_DIR/bin:$PATH python3 -m pytest -m gpu       # no PYTHONPATH
#
# The bundle is kept unpacked in the store, STORE/VERSION
# (HYV4_BUNDLE_STORE, default /tmp/hyv4-bundle): a delta bundle (MANIFEST
# `base=V`) installs the wheels it lacks from STORE/V, so V's bundle is
# installed first. Refuses (one line, exit 1) before unpacking anything when a
# delta's base is not in the store, or a part is missing, corrupt or not
# listed in SHA256SUMS. PYTHON picks the interpreter (python3).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: install.sh PARTS_DIR [ENV_DIR]"
dir=$1 env_dir=${2:-}
store=${HYV4_BUNDLE_STORE:-/tmp/hyv4-bundle}
field() { [ -f "$1" ] && sed -n "s/^$2=//p" "$1" | head -n 1; }   # MANIFEST KEY -> value

base=$(field "$dir/MANIFEST" base)
if [ -n "$base" ] && [ "$(field "$store/$base/MANIFEST" vllm)" != "$base" ]; then
  die "$dir holds a delta over the vLLM $base bundle, which is not in $store/$base: install the $base bundle first"
fi
mkdir -p "$store" || die "cannot create $store"
work=$(mktemp -d "$store/.incoming.XXXXXX") || die "cannot create a folder in $store"
trap 'rm -rf "$work"' EXIT
"$HERE/unpack.sh" "$dir" "$work" || exit 1
version=$(field "$work/bundle/MANIFEST" vllm)
version=${version:-unversioned}   # a bundle from before MANIFEST
[[ $version =~ ^[0-9A-Za-z][0-9A-Za-z.+_-]*$ ]] || die "bundle/MANIFEST names no usable vLLM version: '$version'"
rm -rf "${store:?}/$version" && mv "$work/bundle" "$store/$version" || die "cannot move the bundle to $store/$version"
# The project's copy, not the one in the parts: the same steps, kept current.
bash "$HERE/bundle-install.sh" "${env_dir:-/tmp/vllm-$version}" "$store/$version"
