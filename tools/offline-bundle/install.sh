#!/usr/bin/env bash
# On the GPU host, from the repo root: verify the shipped parts, unpack them
# into the bundle store and install vLLM and the bundled wheels into ENV_DIR,
# a virtual environment on the host's Python (bundle-install.sh):
#
#   tools/offline-bundle/install.sh PARTS_DIR [ENV_DIR]   # ENV_DIR default /tmp/vllm-VERSION
#   PATH=ENV_DIR/bin:$PATH python3 -m pytest -m gpu       # no PYTHONPATH
#   tools/offline-bundle/install.sh --store-only PARTS_DIR  # verified and unpacked into the store only
#
# The bundle is kept unpacked in the store, STORE/VERSION
# (HYV4_BUNDLE_STORE, default /tmp/hyv4-bundle): a delta bundle (MANIFEST
# `base=V`) installs the wheels it lacks from STORE/V, so V's bundle is
# installed first. Refuses (one line, exit 1) before unpacking anything when a
# delta's base is not in the store, or a part is missing, corrupt or not
# listed in SHA256SUMS. PYTHON picks the interpreter (python3). --store-only stops once the
# bundle is in the store: a delta's base on a host that runs only the delta needs no environment
# of its own (about 35 s of a bare host's first verdict), and a packed JIT cache beside the
# parts is then left alone.
#
# Parts with a packed JIT cache beside them (PARTS_DIR/jit-cache/, make-bundle.sh
# --jit-cache) have it checked with the parts (a corrupt part is refused before
# anything is unpacked) and, once vLLM is installed, restored into the cache root
# $HYV4_JIT_CACHE (default /tmp/jit-VERSION) by `python -m harness warmup
# --restore-only`, run with the new environment, which compiles the root's Python
# bytecode layer beside it (the import check already wrote its own modules' there);
# the last line says where the seconds went. A pack of another key (GPU
# architecture, versions) is not used, and a restore that cannot be done (no GPU
# to read the architecture from) is said in one line: the install stands either
# way, the kernels are then compiled on first use.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "offline-bundle: $*" >&2; exit 1; }
store_only=
[ "${1:-}" = --store-only ] && { store_only=1; shift; [ $# -eq 1 ] || die "usage: install.sh --store-only PARTS_DIR"; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: install.sh [--store-only] PARTS_DIR [ENV_DIR]"
dir=$1 env_dir=${2:-}
store=${HYV4_BUNDLE_STORE:-/tmp/hyv4-bundle}
field() { [ -f "$1" ] && sed -n "s/^$2=//p" "$1" | head -n 1; }   # MANIFEST KEY -> value

base=$(field "$dir/MANIFEST" base)
if [ -n "$base" ] && [ "$(field "$store/$base/MANIFEST" vllm)" != "$base" ]; then
  die "$dir holds a delta over the vLLM $base bundle, which is not in $store/$base: install the $base bundle first (install.sh --store-only ITS_PARTS where only the delta is wanted)"
fi
jit=
if [ -d "$dir/jit-cache" ] && [ -z "$store_only" ]; then
  jit=$dir/jit-cache
  msg=$("$HERE/verify.sh" "$jit" 2>&1 >/dev/null) || die "$jit: ${msg#offline-bundle: }"
fi
mkdir -p "$store" || die "cannot create $store"
work=$(mktemp -d "$store/.incoming.XXXXXX") || die "cannot create a folder in $store"
trap 'rm -rf "$work"' EXIT
"$HERE/unpack.sh" "$dir" "$work" || exit 1
version=$(field "$work/bundle/MANIFEST" vllm)
version=${version:-unversioned}   # a bundle from before MANIFEST
[[ $version =~ ^[0-9A-Za-z][0-9A-Za-z.+_-]*$ ]] || die "bundle/MANIFEST names no usable vLLM version: '$version'"
rm -rf "${store:?}/$version" && mv "$work/bundle" "$store/$version" || die "cannot move the bundle to $store/$version"
t_unpacked=$SECONDS
if [ -n "$store_only" ]; then
  echo "offline-bundle: $SECONDS s: the vLLM $version bundle is in $store/$version (no environment: --store-only)"
  exit 0
fi
# The project's copy, not the one in the parts: the same steps, kept current.
env_dir=${env_dir:-/tmp/vllm-$version}
root=${HYV4_JIT_CACHE:-/tmp/jit-$version}
if [ -n "$jit" ]; then
  # with a packed cache, the import check writes its bytecode into the root's bytecode layer
  # (the one the harness reads: harness/ci_speed/jit_cache.py), where the restore's compile of
  # the rest and the first GPU command find it, instead of compiling it again
  env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX="$root/pycache" \
    bash "$HERE/bundle-install.sh" "$env_dir" "$store/$version" || exit $?
else
  bash "$HERE/bundle-install.sh" "$env_dir" "$store/$version" || exit $?
fi
t_installed=$SECONDS
[ -n "$jit" ] || { echo "offline-bundle: $SECONDS s (parts $t_unpacked s, environment $(( t_installed - t_unpacked )) s)"; exit 0; }
# the restore compiles the root's bytecode layer beside it (warmup --restore-only)
out=$(cd "$HERE/../.." && env -u PYTHONPATH "$env_dir/bin/python" -m harness warmup --restore "$(realpath "$jit")" \
      --restore-only --cache "$root" 2>&1)
rc=$?
echo "offline-bundle: $SECONDS s (parts $t_unpacked s, environment $(( t_installed - t_unpacked )) s, JIT cache $(( SECONDS - t_installed )) s)"
if [ "$rc" = 0 ]; then
  printf '%s\n' "$out" | tail -n 1
  echo "run the GPU commands with HYV4_JIT_CACHE=$root as well"
else
  echo "offline-bundle: the packed JIT cache was not restored (exit $rc): $(printf '%s\n' "$out" | tail -n 1)"
fi
