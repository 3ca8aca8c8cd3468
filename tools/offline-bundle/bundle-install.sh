#!/usr/bin/env bash
# Shipped inside the bundle as bundle/install.sh; install.sh runs it after
# verify + unpack. Makes ENV_DIR a virtual environment of the host's Python
# that also sees the host's packages (torch, triton, transformers, ...), puts
# vLLM and the bundled wheels into it, and checks what imports:
#
#   bash BUNDLE_DIR/install.sh [ENV_DIR]          # ENV_DIR default /tmp/vllm-VERSION
#   PATH=ENV_DIR/bin:$PATH python3 ...            # no PYTHONPATH
#
# Why a virtual environment: the wheels' .pth files (the CuTe DSL's
# nvidia_cutlass_dsl_packages.pth puts nvidia_cutlass_dsl/dsl_packages, where
# `cutlass` lives, on sys.path) run only in a site-packages folder that Python
# itself processes at start-up; a PYTHONPATH entry is never processed, so with
# the old `pip install --target SITE` + PYTHONPATH, `import cutlass` failed.
# ENV_DIR/lib/pythonX.Y/site-packages is such a folder. The host's own
# environment is not changed: the venv is created with --system-site-packages,
# and when the host's python3 is itself a venv (its packages then are not the
# base interpreter's), 00-hyv4-host-site.pth adds the host venv's
# site-packages after ENV_DIR's own, so a bundled wheel wins over a host copy.
#
# A delta bundle (MANIFEST `base=V`) installs its own wheels and, for every
# other project, the wheel of V's bundle, found unpacked beside this one
# (BUNDLE_DIR/../V, or HYV4_BASE_BUNDLE). ENV_DIR is replaced when it is a
# venv, refused when it is anything else, and removed again when the install
# fails. PYTHON picks the interpreter (python3).
set -euo pipefail
ENV_DIR=${1:-}
HERE=${2:-$(cd "$(dirname "$0")" && pwd)}
PYTHON=${PYTHON:-python3}
die() { echo "offline-bundle: $*" >&2; exit 1; }
field() { if [ -f "$1" ]; then sed -n "s/^$2=//p" "$1" | head -n 1; fi; }   # MANIFEST KEY -> value
project() { local n=${1##*/}; n=${n%%-*}; n=${n,,}; echo "${n//[._]/-}"; }   # a wheel file -> its project
[ -f "$HERE/vllm.tar.xz" ] || die "$HERE/vllm.tar.xz is missing: not an unpacked bundle"
version=$(field "$HERE/MANIFEST" vllm)
version=${version:-unversioned}
base=$(field "$HERE/MANIFEST" base)
ENV_DIR=${ENV_DIR:-/tmp/vllm-$version}

# The host's interpreter, resolved once, and never ENV_DIR's own: with ENV_DIR/bin first on PATH (as
# the usage above runs the GPU commands), `python3` named the old environment before it was removed
# and the new one after, and the new environment was built on itself, without the host's packages.
env_phys=$(realpath -m -- "$ENV_DIR")
PATH=$(printf '%s\n' "$PATH" | tr ':' '\n' | { grep -vxF -e "$ENV_DIR/bin" -e "$env_phys/bin" || true; } | paste -sd: -)
py=$(command -v -- "$PYTHON") || die "PYTHON=$PYTHON: no such interpreter on PATH (ENV_DIR/bin left out: it is replaced)"
py_dir=$(cd "$(dirname -- "$py")" && pwd -P) || die "PYTHON=$PYTHON: cannot resolve $py"
case "$py_dir/" in
  "$env_phys/"*) die "PYTHON=$PYTHON is $py, inside $ENV_DIR, which this install replaces: name the host's interpreter" ;;
esac
PYTHON=$py_dir/${py##*/}

# A bundle's wheels come as deps.tar.xz (stored wheels, xz'd together) or, in
# bundles from before it, as deps/*.whl; deps/ is unpacked once and reused.
untar_xz() {  # untar_xz TARBALL DEST: quiet; on failure, the first line xz or tar said, on stdout
  local err
  err=$( { xz -T0 -d < "$1" | tar -x -C "$2"; } 2>&1 >/dev/null ) || { printf '%s\n' "${err%%$'\n'*}"; return 1; }
}
unpack_wheels() {
  local d=$1
  [ -d "$d/deps" ] || [ ! -f "$d/deps.tar.xz" ] || {
    rm -rf "$d/.deps.tmp" && mkdir "$d/.deps.tmp" || die "cannot write in $d"
    msg=$(untar_xz "$d/deps.tar.xz" "$d/.deps.tmp") || die "$d/deps.tar.xz does not unpack: $msg"
    { mkdir -p "$d/.deps.tmp/deps" && mv "$d/.deps.tmp/deps" "$d/deps" && rmdir "$d/.deps.tmp"; } ||
      die "cannot move the unpacked wheels to $d/deps"
  }
}
base_dir=
if [ -n "$base" ]; then
  base_dir=${HYV4_BASE_BUNDLE:-$(dirname "$HERE")/$base}
  [ "$(field "$base_dir/MANIFEST" vllm)" = "$base" ] ||
    die "this vLLM $version bundle is a delta over the $base bundle, which is not unpacked at $base_dir: install the $base bundle first"
  unpack_wheels "$base_dir"
fi
unpack_wheels "$HERE"

wheels=()
declare -A own=()
for w in "$HERE"/deps/*.whl; do
  [ -e "$w" ] || continue
  wheels+=("$w"); own[$(project "$w")]=1
done
if [ -n "$base_dir" ]; then
  for w in "$base_dir"/deps/*.whl; do
    [ -e "$w" ] && [ -z "${own[$(project "$w")]:-}" ] && wheels+=("$w")
  done
fi

if [ -e "$ENV_DIR" ]; then
  [ -f "$ENV_DIR/pyvenv.cfg" ] || die "$ENV_DIR exists and is not a virtual environment: not replacing it (remove it or name another ENV_DIR)"
  rm -rf "$ENV_DIR"
fi
installed=0
trap '[ "$installed" = 1 ] || rm -rf "$ENV_DIR"' EXIT
"$PYTHON" -m venv --without-pip --system-site-packages "$ENV_DIR" || die "$PYTHON -m venv cannot create $ENV_DIR"
site=$("$ENV_DIR/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))') ||
  die "the new environment's python does not run: $ENV_DIR/bin/python"
"$PYTHON" - "$site" <<'PY' || die "cannot write the host-site hook into $site"
import os, site, sys
target = sys.argv[1]
if sys.prefix != sys.base_prefix:  # the host's python3 is a venv: its packages are not the base's
    own = os.path.realpath(sys.prefix) + os.sep
    dirs = [d for d in site.getsitepackages() if os.path.isdir(d) and os.path.realpath(d).startswith(own)]
    if dirs:
        with open(os.path.join(target, "00-hyv4-host-site.pth"), "w") as f:
            f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
PY
# vLLM is untarred beside pip's install of the wheels: their top-level names are disjoint (vllm/ is
# in no wheel), and each xz block decompresses on its own core (-T0; an xz without threads ignores it).
untar_xz "$HERE/vllm.tar.xz" "$site" > "$ENV_DIR/.untar-vllm" &
untar=$!
if [ ${#wheels[@]} -gt 0 ]; then
  PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "${wheels[@]}" || { wait "$untar"; die "pip could not install the bundled wheels into $site"; }
fi
wait "$untar" || die "$HERE/vllm.tar.xz does not unpack: $(cat "$ENV_DIR/.untar-vllm")"
rm -f "$ENV_DIR/.untar-vllm"

# The check runs the environment's own python without PYTHONPATH (a PYTHONPATH
# left from the old instructions would hide a .pth that does not work). It
# prints what it sees, fails (one line) unless vLLM and the CuTe DSL with its
# CUDA 13 flavour import, and names vLLM's and flashinfer's pins this host
# does not meet (the host's own packages, and what is left out on purpose).
env -u PYTHONPATH "$ENV_DIR/bin/python" - "$ENV_DIR" <<'PY' || exit 1
import os, re, sys

env = sys.argv[1]


def fail(what, e):
    msg = " ".join(str(e).split())[:300]
    sys.exit(f"offline-bundle: {what} does not import in {env}: {type(e).__name__}: {msg}")


try:
    import torch, vllm
    from vllm.platforms import current_platform
except Exception as e:
    fail("vllm", e)
print("vllm", vllm.__version__, "torch", torch.__version__,
      "platform", type(current_platform).__name__,
      "capability", current_platform.get_device_capability())
try:  # what vLLM's is_cutedsl_available() imports
    import cutlass, cutlass.cute
except Exception as e:
    fail("the CuTe DSL (cutlass, from nvidia_cutlass_dsl_packages.pth)", e)
ir = sys.modules.get("cutlass._mlir._mlir_libs._cutlass_ir")
m = re.search(r"_cutlass_ir\.(cu\d+)\.", os.path.basename(getattr(ir, "__file__", None) or ""))
flavour = m.group(1) if m else "unknown"
print("cutlass-dsl", getattr(cutlass, "__version__", "?"), flavour, "from", os.path.dirname(cutlass.__file__))
if flavour != "cu13":
    sys.exit(f"offline-bundle: the CuTe DSL in {env} loaded its {flavour} flavour, not cu13 (nvidia-cutlass-dsl-libs-cu13)")

try:
    from importlib import metadata
    from packaging.requirements import Requirement
except ImportError:
    sys.exit(0)
unmet = []
for dist in ("vllm", "flashinfer-python"):
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        continue
    for text in reqs:
        try:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{req.name} missing")
            continue
        except Exception:
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{req.name} {have} ({req.specifier})")
if unmet:
    print("pins of vllm / flashinfer-python not met here (the host's own packages, or left out on purpose):",
          ", ".join(sorted(set(unmet))))
PY
installed=1
echo "installed vLLM $version into $ENV_DIR; run the GPU commands with PATH=$ENV_DIR/bin:\$PATH (no PYTHONPATH)"
