#!/usr/bin/env bash
# The wheels a release's bundle ships: extra-wheels.txt with
# extra-wheels-VERSION.txt laid over it (a pin there replaces the same
# project's pin in extra-wheels.txt, or adds one), one `name==version` a line.
# Project names compare as pip does (case, '-', '_' and '.' alike).
#
#   tools/offline-bundle/pins.sh VERSION [BASE_VERSION]
#
# With BASE_VERSION: only the pins VERSION's list holds and BASE_VERSION's
# does not, i.e. what a delta bundle over BASE_VERSION's bundle ships.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "pins: $*" >&2; exit 1; }
[ $# -ge 1 ] && [ $# -le 2 ] || die "usage: pins.sh VERSION [BASE_VERSION]"
for v in "$@"; do
  [[ $v =~ ^[0-9A-Za-z][0-9A-Za-z.+_-]*$ ]] || die "not a vLLM version: '$v'"
done

resolve() {  # VERSION -> its pins, "key name==version" a line (key: the normalised project name)
  local overlay="$HERE/extra-wheels-$1.txt"
  [ -f "$overlay" ] || overlay=/dev/null
  awk '
    { sub(/#.*/, ""); gsub(/^[ \t\r]+|[ \t\r]+$/, "") }
    $0 == "" { next }
    $0 !~ /^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9._+!-]+$/ {
      printf "pins: %s line %d is not a name==version pin: %s\n", FILENAME, FNR, $0 > "/dev/stderr"; bad = 1; exit 1
    }
    { split($0, p, "=="); key = tolower(p[1]); gsub(/[-_.]+/, "-", key)
      if (!(key in pin)) order[++n] = key
      pin[key] = key "==" p[2] " " $0 }
    END { if (!bad) for (i = 1; i <= n; i++) print pin[order[i]] }
  ' "$HERE/extra-wheels.txt" "$overlay"
}

if [ $# -eq 1 ]; then
  resolve "$1" | cut -d' ' -f2
else
  base=$(resolve "$2" | cut -d' ' -f1)
  resolve "$1" | awk -v base="$base" '
    BEGIN { n = split(base, b, "\n"); for (i = 1; i <= n; i++) have[b[i]] = 1 }
    !($1 in have) { print $2 }'
fi
