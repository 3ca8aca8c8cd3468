#!/usr/bin/env bash
# Build an offline bundle of vLLM for a GPU host that has CUDA, PyTorch and
# Triton but no package index, split into parts small enough to ship one at a
# time. Run where PyPI is reachable, from the repo root:
#
#   tools/offline-bundle/make-bundle.sh [OUT_DIR] [PART_BYTES]
#
# OUT_DIR    where the parts go (default .gpu-bundle, git-ignored):
#            OUT_DIR/part.00, part.01, ... and OUT_DIR/SHA256SUMS
# PART_BYTES largest part (default 50000000: a part plus the ~8 MB working tree must
# stay under a 64 MiB transfer; 60 MB parts stopped fitting once the tree grew)
#
# The bundle holds the vLLM wheel pinned below minus what strip.txt lists
# (pieces the Hopper MTP path never loads), the wheels pinned in
# extra-wheels.txt that the GPU host lacks, and bundle/install.sh. The host's
# own torch is used: vLLM's extensions are built on the stable libtorch ABI.
# Environment: VLLM_VERSION (0.33.0), GPU_HOST_PYTHON (3.12),
# GPU_BUNDLE_CACHE (~/.cache/gpu-bundle/vllm-VERSION-pyPY).
# Download happens here; strip.sh strips, pack.sh splits and checksums.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-.gpu-bundle}
PART=${2:-50000000}
VLLM_VERSION=${VLLM_VERSION:-0.33.0}
PY=${GPU_HOST_PYTHON:-3.12}
CACHE=${GPU_BUNDLE_CACHE:-$HOME/.cache/gpu-bundle/vllm-$VLLM_VERSION-py$PY}
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_31_x86_64
      --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64)
for tool in python3 unzip tar xz split sha256sum; do
  command -v "$tool" >/dev/null || { echo "make-bundle: needs $tool on PATH" >&2; exit 1; }
done

STAGE="$CACHE/stage"
mkdir -p "$CACHE/wheels" "$STAGE/bundle/deps"
echo "fetching the wheels pinned in extra-wheels.txt ..."
rm -f "$STAGE"/bundle/deps/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
    --implementation cp "${PLAT[@]}" -d "$STAGE/bundle/deps" -r "$HERE/extra-wheels.txt"

# The stripped vLLM tarball is cached; a change of strip.txt rebuilds it.
strip_key=$(sha256sum "$HERE/strip.txt" | cut -c1-16)
if [ ! -f "$STAGE/bundle/vllm.tar.xz" ] || [ "$(cat "$CACHE/vllm.strip-key" 2>/dev/null)" != "$strip_key" ]; then
  echo "downloading vllm==$VLLM_VERSION ..."
  python3 -m pip download -q --no-deps -d "$CACHE/wheels" "vllm==$VLLM_VERSION"
  rm -rf "$CACHE/unz" && mkdir -p "$CACHE/unz"
  (cd "$CACHE/unz" && unzip -q "$CACHE"/wheels/vllm-"$VLLM_VERSION"-*.whl)
  echo "stripping and compressing vllm (a few minutes) ..."
  "$HERE/strip.sh" "$CACHE/unz" "$STAGE/bundle/vllm.tar.xz"
  echo "$strip_key" > "$CACHE/vllm.strip-key"
  rm -rf "$CACHE/unz"
fi
cp "$HERE/bundle-install.sh" "$STAGE/bundle/install.sh"
"$HERE/pack.sh" "$STAGE" "$OUT" "$PART"
