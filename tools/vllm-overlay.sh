#!/usr/bin/env bash
# One bisect step on a vLLM source tree without rebuilding CUDA: the Python files of the
# checked-out commit laid over a copy of an installed release's vLLM package (whose compiled
# extensions, *.so, stay), the way vLLM's own VLLM_USE_PRECOMPILED reuses a release wheel's
# binaries. Between most commits only Python changes; a commit whose compiled sources differ
# from the release's cannot be judged this way and is skipped (exit 125).
#
#   tools/vllm-overlay.sh SRC_TREE RELEASE_SITE OUT_SITE [RELEASE_TAG]
#
# SRC_TREE      a vLLM git checkout at the commit under test
# RELEASE_SITE  a site folder (or venv site-packages) holding the release's installed `vllm/`
#               (e.g. the offline bundle's: tools/offline-bundle/README.md)
# OUT_SITE      written afresh: RELEASE_SITE's vllm/ with SRC_TREE's vllm/**/*.py over it;
#               put it first on PYTHONPATH (before RELEASE_SITE) for the harness
# RELEASE_TAG   the tag RELEASE_SITE was built from (default: v + its vllm.__version__ as
#               written in vllm/_version.py); the compiled sources (csrc/, CMakeLists.txt,
#               cmake/, setup.py) must not differ between it and HEAD
# Exit: 0 ready; 125 cannot judge this commit this way (compiled sources changed, tag unknown);
# 2 bad arguments (one line naming the path).
set -uo pipefail
src=${1:-}; rel=${2:-}; out=${3:-}; tag=${4:-}
die() { echo "vllm-overlay: $1" >&2; exit "${2:-2}"; }
[ -n "$src" ] && [ -n "$rel" ] && [ -n "$out" ] || die "usage: tools/vllm-overlay.sh SRC_TREE RELEASE_SITE OUT_SITE [RELEASE_TAG]"
[ -d "$src/vllm" ] && git -C "$src" rev-parse --git-dir >/dev/null 2>&1 || die "$src: not a vLLM git checkout (no vllm/ or no .git)"
[ -d "$rel/vllm" ] || die "$rel: no installed vllm/ package here"
case $(cd "$(dirname "$out")" 2>/dev/null && pwd)/$(basename "$out") in
  "$(cd "$rel" && pwd)"|"$(cd "$src" && pwd)") die "$out: OUT_SITE must differ from SRC_TREE and RELEASE_SITE" ;;
esac
if [ -z "$tag" ]; then
  ver=$(sed -n "s/^__version__ *= *version *= *['\"]\([^'\"+]*\).*/\1/p; s/^__version__ *= *['\"]\([^'\"+]*\).*/\1/p" \
        "$rel/vllm/_version.py" 2>/dev/null | head -1)
  [ -n "$ver" ] || die "$rel/vllm/_version.py: no __version__; give RELEASE_TAG" 125
  tag=v$ver
fi
git -C "$src" rev-parse -q --verify "$tag^{commit}" >/dev/null || die "$tag: no such tag in $src (fetch the release tags)" 125
changed=$(git -C "$src" diff --name-only "$tag" HEAD -- csrc CMakeLists.txt cmake setup.py 2>/dev/null | head -3)
if [ -n "$changed" ]; then
  echo "vllm-overlay: compiled sources differ from $tag ($(echo "$changed" | tr '\n' ' ')): rebuild to judge this commit" >&2
  exit 125
fi
out=$(cd "$(dirname "$out")" 2>/dev/null && pwd)/$(basename "$out") || die "$out: its parent folder does not exist"
tmp="$out.tmp-$$"
trap 'rm -rf "$tmp"' EXIT
rm -rf "$tmp" && mkdir -p "$tmp" || die "$out: cannot write" 125
cp -a "$rel/vllm" "$tmp/vllm" || die "$out: copy of $rel/vllm failed" 125
# the commit's tracked Python files over the release's; a file the commit deleted since the release
# goes too. Files the release's build generated or installed (vllm/_version.py, vllm_flash_attn/,
# third_party/deep_gemm/ ...) are not tracked in the source tree and stay as the release has them.
git -C "$src" diff --name-only --diff-filter=D "$tag" HEAD -- vllm | while read -r f; do rm -f "$tmp/$f"; done
git -C "$src" ls-files -z -- 'vllm/*.py' | (cd "$src" && xargs -0 -r cp --parents -t "$tmp") \
  || die "$src: copying its Python files failed" 125
find "$tmp/vllm" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$out" && mv "$tmp" "$out" || die "$out: cannot install the overlay" 125
trap - EXIT
echo "vllm-overlay: $out = $rel/vllm (compiled: $tag) + $(git -C "$src" rev-parse --short HEAD)'s Python"
