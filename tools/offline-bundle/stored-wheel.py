"""Rewrite wheels with every member stored instead of deflated (make-bundle.sh's step).

    python3 stored-wheel.py OUT_DIR IN.whl [IN.whl ...]

Each OUT_DIR/<name of IN.whl> holds the same members, in the same order, with
the same bytes, names, times and permission bits, so its RECORD still matches
and pip installs it exactly as the published wheel. Only the zip's own
compression is gone: the bundle xz-compresses its wheels together, and xz over
raw bytes shrinks them far more than over deflate streams (flashinfer-python
0.7.4: 101 MB published, 26 MB stored + xz). Reading a member checks its CRC,
so a corrupt download stops here. A wheel is written under a temporary name and
renamed when complete.
"""

from __future__ import annotations

import os
import shutil
import sys
import zipfile


def stored_copy(src: str, dst: str) -> None:
    """Copy the wheel ``src`` to ``dst`` with every member ZIP_STORED."""
    tmp = dst + ".tmp"
    try:
        with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                out = zipfile.ZipInfo(info.filename, info.date_time)
                out.external_attr = info.external_attr
                out.create_system = info.create_system
                out.compress_type = zipfile.ZIP_STORED
                if info.is_dir():
                    zout.writestr(out, b"")
                    continue
                out.file_size = info.file_size
                with zin.open(info) as fin, zout.open(out, "w", force_zip64=info.file_size >= 2**31) as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("stored-wheel: usage: stored-wheel.py OUT_DIR IN.whl [IN.whl ...]", file=sys.stderr)
        return 1
    out_dir, wheels = argv[0], argv[1:]
    for src in wheels:
        try:
            stored_copy(src, os.path.join(out_dir, os.path.basename(src)))
        except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
            print(f"stored-wheel: {src}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
