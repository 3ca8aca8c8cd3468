#!/usr/bin/env bash
# Check the shipped parts against SHA256SUMS before anything is unpacked:
#
#   tools/offline-bundle/verify.sh PARTS_DIR
#
# Exit 0 and one "ok" line when every part listed in SHA256SUMS is present and
# matches, the parts are numbered part.00, part.01, ... without a gap, and no
# unlisted part.* lies in the folder (a leftover would corrupt `cat part.*`).
# Otherwise exit 1 with one line naming the bad part. Accepts the parts of the
# workplace script this replaced (same format).
set -uo pipefail
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ $# -eq 1 ] || die "usage: verify.sh PARTS_DIR"
dir=$1
[ -d "$dir" ] || die "no such folder: $dir"
command -v sha256sum >/dev/null || die "needs sha256sum on PATH"
sums="$dir/SHA256SUMS"
[ -f "$sums" ] || die "$sums is missing: ship it with the parts"
listed=" "
n=0
width=
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%$'\r'}   # a SHA256SUMS that crossed a Windows machine
  [ -n "$line" ] || continue
  hash=${line%% *}
  name=${line#* }; name=${name# }; name=${name#\*}
  [[ $hash =~ ^[0-9a-fA-F]{64}$ && $name =~ ^part\.[0-9]+$ ]] || die "SHA256SUMS line $((n + 1)) is not '<sha256>  part.NN': $line"
  suffix=${name#part.}
  width=${width:-${#suffix}}
  expect=$(printf "part.%0${width}d" "$n")
  [ "$name" = "$expect" ] || die "SHA256SUMS lists $name where $expect belongs (a part left out of the list?)"
  [ -f "$dir/$name" ] || die "$name is missing (listed in SHA256SUMS)"
  got=$(sha256sum < "$dir/$name") || die "$name cannot be read"
  got=${got%% *}
  [ "$got" = "${hash,,}" ] || die "$name is corrupt: sha256 ${got:0:12}... != SHA256SUMS ${hash:0:12}... (ship it again)"
  listed+="$name "
  n=$((n + 1))
done < "$sums"
[ "$n" -gt 0 ] || die "SHA256SUMS lists no parts"
for p in "$dir"/part.*; do
  [ -e "$p" ] || continue
  name=${p##*/}
  [[ $listed == *" $name "* ]] || die "$name is not listed in SHA256SUMS (left over from another build? remove it)"
done
echo "offline-bundle: $n parts match SHA256SUMS"
