#!/usr/bin/env bash
# On the GPU host, from the repo root: verify the shipped parts, unpack them
# and install vLLM and the bundled wheels into SITE.
#
#   tools/offline-bundle/install.sh PARTS_DIR [SITE]     # SITE default /tmp/site
#   export PYTHONPATH=SITE:$PWD
#
# Refuses (one line, exit 1) before unpacking anything when a part is missing,
# corrupt or not listed in SHA256SUMS. PYTHON picks the interpreter (python3);
# TMPDIR where the parts are joined (about the size of the parts, removed after).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: install.sh PARTS_DIR [SITE]"
dir=$1 site=${2:-/tmp/site}
work=$(mktemp -d "${TMPDIR:-/tmp}/offline-bundle.XXXXXX") || die "cannot create a temporary folder"
trap 'rm -rf "$work"' EXIT
"$HERE/unpack.sh" "$dir" "$work" || exit 1
# The project's copy, not the one in the parts: the same steps, kept current.
bash "$HERE/bundle-install.sh" "$site" "$work/bundle"
