#!/usr/bin/env bash
# Build an offline bundle of vLLM for a GPU host that has CUDA, PyTorch and
# Triton but no package index, split into parts small enough to ship one at a
# time. Run where PyPI is reachable, from the repo root:
#
#   tools/offline-bundle/make-bundle.sh [OUT_DIR] [PART_BYTES] [--base VERSION] [--jit-cache PACK_DIR]
#
# OUT_DIR    where the parts go (default .gpu-bundle, git-ignored):
#            OUT_DIR/part.00, part.01, ..., OUT_DIR/SHA256SUMS, OUT_DIR/MANIFEST
# PART_BYTES largest part (default 50000000: a part plus the ~10 MB working tree must
#            stay under a 64 MiB transfer)
# --base V   a delta over the bundle of vLLM V: only the vLLM tarball and the
#            wheels whose pin differs from V's (pins.sh VERSION V); its install
#            needs V's bundle installed first. GPU_BUNDLE_BASE says the same.
# --jit-cache PACK_DIR
#            an extra part set: the JIT cache `python -m harness warmup --pack PACK_DIR`
#            packed on a warmed GPU host of the target architecture running this vLLM
#            release (add-jit-cache.sh checks both), copied to OUT_DIR/jit-cache/
#            (part.NN, SHA256SUMS, MANIFEST); install.sh restores it, so the host's
#            first run compiles nothing. Without it an OUT_DIR/jit-cache/ of an
#            earlier build is removed.
#
# The bundle holds the vLLM wheel minus what strip.txt lists (pieces the
# Hopper MTP path never loads) as vllm.tar.xz, the wheels pins.sh lists for
# the release (extra-wheels.txt, with extra-wheels-VERSION.txt over it) as
# deps.tar.xz (each wheel stored, not deflated: stored-wheel.py), MANIFEST
# (`vllm=VERSION`, and `base=V` for a delta) and bundle/install.sh. The host's
# own torch is used: vLLM's extensions are built on the stable libtorch ABI.
# Environment: VLLM_VERSION (0.33.0), VLLM_WHEEL (a vLLM wheel already on disk:
# no download), GPU_HOST_PYTHON (3.12), GPU_BUNDLE_CACHE
# (~/.cache/gpu-bundle/vllm-VERSION-pyPY).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "make-bundle: $*" >&2; exit 1; }
args=()
BASE=${GPU_BUNDLE_BASE:-}
JIT=
usage="usage: make-bundle.sh [OUT_DIR] [PART_BYTES] [--base VERSION] [--jit-cache PACK_DIR]"
while [ $# -gt 0 ]; do
  case $1 in
    --base) [ $# -ge 2 ] || die "--base needs a vLLM version"; BASE=$2; shift 2 ;;
    --base=*) BASE=${1#--base=}; shift ;;
    --jit-cache) [ $# -ge 2 ] || die "--jit-cache needs the folder warmup --pack wrote"; JIT=$2; shift 2 ;;
    --jit-cache=*) JIT=${1#--jit-cache=}; shift ;;
    -*) die "unknown option $1 ($usage)" ;;
    *) args+=("$1"); shift ;;
  esac
done
[ ${#args[@]} -le 2 ] || die "$usage"
OUT=${args[0]:-.gpu-bundle}
PART=${args[1]:-50000000}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
[ "$BASE" != "$VLLM_VERSION" ] || die "--base $BASE is the release being bundled"
PY=${GPU_HOST_PYTHON:-3.12}
CACHE=${GPU_BUNDLE_CACHE:-$HOME/.cache/gpu-bundle/vllm-$VLLM_VERSION-py$PY}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64)
for tool in python3 unzip tar xz split sha256sum; do
  command -v "$tool" >/dev/null || die "needs $tool on PATH"
done
if [ -n "${VLLM_WHEEL:-}" ]; then
  [ -f "$VLLM_WHEEL" ] || die "VLLM_WHEEL=$VLLM_WHEEL is not a file"
  [[ ${VLLM_WHEEL##*/} == vllm-"$VLLM_VERSION"-*.whl ]] || die "VLLM_WHEEL=$VLLM_WHEEL is not a vllm $VLLM_VERSION wheel"
fi
pins=$("$HERE/pins.sh" "$VLLM_VERSION" ${BASE:+"$BASE"})
if [ -n "$JIT" ]; then  # checked before the long steps: a pack of another release is refused now
  "$HERE/add-jit-cache.sh" "$JIT" - "$VLLM_VERSION" || exit 1
fi

# One stage per (release, base): a full bundle and a delta of the same release
# hold different wheels.
STAGE="$CACHE/stage${BASE:+-over-$BASE}"
mkdir -p "$STAGE/bundle"
rm -rf "$STAGE/bundle/deps"   # the unpacked wheels of an earlier format

# The wheels: downloaded, stored (not deflated), tarred and xz-compressed; the
# result is cached, keyed on the pin list, the repacking script and the xz
# preset. -9's 64 MiB dictionary spans many of flashinfer's similar sources:
# 0.33.0's wheels 114.8 MB (-6: 119.3), 0.34.0's delta 26.2 MB (-6: 28.4).
XZ_DEPS=(-T0 -9)
deps_key=$({ printf '%s\n' "$pins" "${XZ_DEPS[*]}"; cat "$HERE/stored-wheel.py"; } | sha256sum | cut -c1-16)
if [ ! -f "$STAGE/bundle/deps.tar.xz" ] || [ "$(cat "$STAGE/deps.key" 2>/dev/null)" != "$deps_key" ]; then
  rm -rf "$STAGE/published" "$STAGE/deps"
  mkdir -p "$STAGE/published" "$STAGE/deps"
  if [ -n "$pins" ]; then
    echo "fetching $(printf '%s\n' "$pins" | wc -l) pinned wheels (pins.sh $VLLM_VERSION${BASE:+ $BASE}) ..."
    printf '%s\n' "$pins" > "$STAGE/pins.txt"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
        --implementation cp "${PLAT[@]}" -d "$STAGE/published" -r "$STAGE/pins.txt"
    python3 "$HERE/stored-wheel.py" "$STAGE/deps" "$STAGE"/published/*.whl
  fi
  echo "compressing the wheels (a few minutes) ..."
  (cd "$STAGE" && tar --sort=name --owner=0 --group=0 --numeric-owner -cf - deps) | xz "${XZ_DEPS[@]}" > "$STAGE/deps.tar.xz.tmp"
  mv "$STAGE/deps.tar.xz.tmp" "$STAGE/bundle/deps.tar.xz"
  echo "$deps_key" > "$STAGE/deps.key"
  rm -rf "$STAGE/published" "$STAGE/deps"
fi

# The stripped vLLM tarball is cached; a change of strip.txt or strip.sh (or of
# the wheel) rebuilds it.
strip_key="$(cat "$HERE/strip.txt" "$HERE/strip.sh" | sha256sum | cut -c1-16) ${VLLM_WHEEL:+${VLLM_WHEEL##*/}}"
if [ ! -f "$CACHE/vllm.tar.xz" ] || [ "$(cat "$CACHE/vllm.strip-key" 2>/dev/null)" != "$strip_key" ]; then
  wheel=${VLLM_WHEEL:-}
  if [ -z "$wheel" ]; then
    echo "downloading vllm==$VLLM_VERSION ..."
    mkdir -p "$CACHE/wheels"
    python3 -m pip download -q --no-deps -d "$CACHE/wheels" "vllm==$VLLM_VERSION"
    wheel=$(ls "$CACHE"/wheels/vllm-"$VLLM_VERSION"-*.whl | head -n 1)
  fi
  rm -rf "$CACHE/unz" && mkdir -p "$CACHE/unz"
  (cd "$CACHE/unz" && unzip -q "$wheel")
  echo "stripping and compressing vllm (a few minutes) ..."
  "$HERE/strip.sh" "$CACHE/unz" "$CACHE/vllm.tar.xz"
  echo "$strip_key" > "$CACHE/vllm.strip-key"
  rm -rf "$CACHE/unz"
fi
ln -f "$CACHE/vllm.tar.xz" "$STAGE/bundle/vllm.tar.xz" 2>/dev/null || cp "$CACHE/vllm.tar.xz" "$STAGE/bundle/vllm.tar.xz"

{ echo "vllm=$VLLM_VERSION"; [ -z "$BASE" ] || echo "base=$BASE"; } > "$STAGE/bundle/MANIFEST"
cp "$HERE/bundle-install.sh" "$STAGE/bundle/install.sh"
"$HERE/pack.sh" "$STAGE" "$OUT" "$PART"
rm -rf "$OUT/jit-cache"
if [ -n "$JIT" ]; then "$HERE/add-jit-cache.sh" "$JIT" "$OUT" "$VLLM_VERSION" || exit 1; fi
