#!/usr/bin/env bash
# Shipped inside the bundle as bundle/install.sh; install.sh runs it after
# verify + unpack. Installs the unpacked bundle into SITE (pip --target: the
# host's own environment is not touched) and prints what it sees:
#
#   bash BUNDLE_DIR/install.sh [SITE]          # SITE default /tmp/site
#
# Then: export PYTHONPATH=SITE. PYTHON picks the interpreter (python3).
set -euo pipefail
SITE=${1:-/tmp/site}
HERE=${2:-$(cd "$(dirname "$0")" && pwd)}
PYTHON=${PYTHON:-python3}
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ -f "$HERE/vllm.tar.xz" ] || die "$HERE/vllm.tar.xz is missing: not an unpacked bundle"
mkdir -p "$SITE"
xz -d < "$HERE/vllm.tar.xz" | tar -x -C "$SITE" || die "$HERE/vllm.tar.xz does not unpack"
wheels=("$HERE"/deps/*.whl)
if [ -e "${wheels[0]}" ]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "${wheels[@]}" || die "pip could not install the bundled wheels into $SITE"
fi
PYTHONPATH="$SITE" "$PYTHON" - <<'PY' || die "vllm does not import from $SITE (see above)"
import torch, vllm
from vllm.platforms import current_platform
print("vllm", vllm.__version__, "torch", torch.__version__,
      "platform", type(current_platform).__name__,
      "capability", current_platform.get_device_capability())
PY
echo "installed into $SITE; export PYTHONPATH=$SITE"
