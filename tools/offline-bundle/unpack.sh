#!/usr/bin/env bash
# Verify the shipped parts, then join and untar them:
#
#   tools/offline-bundle/unpack.sh PARTS_DIR DEST
#
# Leaves DEST/bundle/ (vllm.tar.xz, deps.tar.xz or deps/, install.sh, MANIFEST).
# One line and exit 1 when a part is missing or corrupt (verify.sh), the
# archive does not unpack, or PARTS_DIR/MANIFEST is not the parts' own (a
# leftover of another build would name the wrong base).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
die() { echo "offline-bundle: $*" >&2; exit 1; }
[ $# -eq 2 ] || die "usage: unpack.sh PARTS_DIR DEST"
dir=$1 dest=$2
"$HERE/verify.sh" "$dir" || exit 1
parts=()
while IFS= read -r line || [ -n "$line" ]; do
  line=${line%$'\r'}   # a SHA256SUMS that crossed a Windows machine
  [ -n "$line" ] || continue
  name=${line#* }; name=${name# }; name=${name#\*}
  parts+=("$dir/$name")
done < "$dir/SHA256SUMS"
mkdir -p "$dest" || die "cannot create $dest"
err=$(mktemp)
trap 'rm -f "$err"' EXIT
cat "${parts[@]}" | tar -x -C "$dest" 2>"$err" || die "the joined parts do not untar: $(head -n 1 "$err")"
[ -f "$dest/bundle/vllm.tar.xz" ] || die "the parts hold no bundle/vllm.tar.xz: not an offline bundle"
if [ -f "$dir/MANIFEST" ] && ! cmp -s "$dir/MANIFEST" "$dest/bundle/MANIFEST"; then
  rm -rf "$dest/bundle"
  die "$dir/MANIFEST is not the one packed in these parts (left over from another build? ship the parts' own)"
fi
echo "offline-bundle: ${#parts[@]} parts unpacked into $dest/bundle"
