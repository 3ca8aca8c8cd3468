"""tools/offline-bundle: pack, verify, unpack and install, on a fake bundle (no network).

The fake bundle has the real layout (bundle/vllm.tar.xz, bundle/deps/*.whl,
bundle/install.sh) with stand-in `vllm` and `torch` packages and one trivial wheel, so
the whole host-side path runs here; only make-bundle.sh's download and strip
step (pip download from PyPI) is not exercised; its strip step is (strip.sh).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "offline-bundle"
PART = 10_000  # small parts: the fake bundle splits into several

_missing = [t for t in ("bash", "tar", "xz", "split", "sha256sum") if shutil.which(t) is None]
pytestmark = pytest.mark.skipif(bool(_missing), reason=f"needs {', '.join(_missing)} on PATH")


def _sh(*args, env=None):
    return subprocess.run(["bash", *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _wheel(path: pathlib.Path) -> None:
    """A minimal valid pure-Python wheel: hyv4_fake_dep 1.0."""
    files = {
        "hyv4_fake_dep.py": b"VALUE = 42\n",
        "hyv4_fake_dep-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: hyv4-fake-dep\nVersion: 1.0\n",
        "hyv4_fake_dep-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append("hyv4_fake_dep-1.0.dist-info/RECORD,,")
    files["hyv4_fake_dep-1.0.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def _stage(root: pathlib.Path) -> pathlib.Path:
    """STAGE_DIR/bundle/ as make-bundle.sh leaves it, with a stand-in vllm."""
    bundle = root / "bundle"
    (bundle / "deps").mkdir(parents=True)
    members = {
        "vllm/__init__.py": b'__version__ = "0.0.fake"\n',
        "vllm/platforms/__init__.py": (b"class FakePlatform:\n    def get_device_capability(self):\n"
                                       b"        return None\n\ncurrent_platform = FakePlatform()\n"),
        # a stand-in torch too: the install check imports torch, and the real
        # import takes seconds (up to 20 s on the busy CI cores)
        "torch/__init__.py": b'__version__ = "0.0.fake-torch"\n',
        # incompressible filler so the packed tar spans several PART-byte parts
        "vllm/filler.bin": hashlib.shake_256(b"filler").digest(30_000),
    }
    with tarfile.open(bundle / "vllm.tar.xz", "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    _wheel(bundle / "deps" / "hyv4_fake_dep-1.0-py3-none-any.whl")
    shutil.copy(TOOLS / "bundle-install.sh", bundle / "install.sh")
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(stage, parts dir) packed once by pack.sh; tests copy the parts before changing them."""
    root = tmp_path_factory.mktemp("bundle")
    stage = _stage(root / "stage")
    r = _sh(TOOLS / "pack.sh", stage, root / "parts", PART)
    assert r.returncode == 0, r.stderr
    return stage, root / "parts"


@pytest.fixture
def parts(packed, tmp_path):
    out = tmp_path / "parts"
    shutil.copytree(packed[1], out)
    return out


def _refusal(r, *needles):
    """Exit 1 with exactly one line on stderr that names the culprit."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_scripts_parse():
    for script in sorted(TOOLS.glob("*.sh")):
        r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert r.returncode == 0, (script.name, r.stderr)
        assert os.access(script, os.X_OK), f"{script.name} is not executable"


def test_pack_splits_into_checksummed_parts(packed):
    stage, out = packed
    names = sorted(p.name for p in out.glob("part.*"))
    assert len(names) >= 3 and names == [f"part.{i:02d}" for i in range(len(names))]
    assert all((out / n).stat().st_size <= PART for n in names)
    sums = dict(reversed(line.split("  ", 1)) for line in (out / "SHA256SUMS").read_text().splitlines())
    assert sorted(sums) == names
    for n in names:
        assert sums[n] == hashlib.sha256((out / n).read_bytes()).hexdigest()
    joined = b"".join((out / n).read_bytes() for n in names)
    with tarfile.open(fileobj=io.BytesIO(joined)) as tar:
        assert {"bundle/vllm.tar.xz", "bundle/install.sh",
                "bundle/deps/hyv4_fake_dep-1.0-py3-none-any.whl"} <= set(tar.getnames())


def test_pack_refuses_a_folder_without_a_bundle(tmp_path):
    r = _sh(TOOLS / "pack.sh", tmp_path, tmp_path / "out")
    _refusal(r, "vllm.tar.xz is missing")


def test_verify_accepts_good_parts(parts):
    r = _sh(TOOLS / "verify.sh", parts)
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"offline-bundle: \d+ parts match SHA256SUMS", r.stdout.strip())


def test_verify_accepts_parts_of_the_old_workplace_script(packed, tmp_path):
    """The parts shipped today were built by the workplace make-bundle.sh: its
    exact pack commands (split without -a, sha256sum in text mode)."""
    stage, _ = packed
    out = tmp_path / "old"
    out.mkdir()
    r = subprocess.run(["bash", "-c", f'set -euo pipefail; (cd "{stage}" && tar -cf - bundle) | '
                        f'split -b {PART} -d - "{out}/part."; (cd "{out}" && sha256sum part.* > SHA256SUMS)'],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _sh(TOOLS / "verify.sh", out).returncode == 0
    r = _sh(TOOLS / "unpack.sh", out, tmp_path / "dest")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "dest" / "bundle" / "vllm.tar.xz").read_bytes() == (stage / "bundle" / "vllm.tar.xz").read_bytes()


def test_strip_leaves_out_what_strip_txt_lists(tmp_path):
    """make-bundle.sh's strip step on a fake unzipped wheel: the listed pieces go, the rest stays."""
    src = tmp_path / "unz"
    gone = ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs/bin/vllm-rs", "vllm/third_party/fmha_sm100/k.so",
            "vllm/_qutlass_C.abi3.so", "vllm/_flashkda_C.abi3.so", "vllm/__pycache__/x.pyc",
            "vllm/platforms/__pycache__/y.pyc", "not-vllm/other.py"]
    kept = ["vllm/__init__.py", "vllm/_C.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
            "vllm/third_party/other/keep.py", "vllm/platforms/__init__.py", "vllm-0.33.0.dist-info/METADATA"]
    for name in gone + kept:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(name)
    out = tmp_path / "vllm.tar.xz"
    r = _sh(TOOLS / "strip.sh", src, out)
    assert r.returncode == 0, r.stderr
    with tarfile.open(out) as tar:
        files = {m.name for m in tar.getmembers() if m.isfile()}
    assert files == set(kept)
    _refusal(_sh(TOOLS / "strip.sh", tmp_path / "nothing", out), "not an unzipped vLLM wheel")


@pytest.mark.parametrize("script", ["verify.sh", "install.sh"])
def test_a_corrupt_part_is_refused_naming_it(parts, tmp_path, script):
    p = parts / "part.01"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))
    r = _sh(TOOLS / script, parts, *([tmp_path / "site"] if script == "install.sh" else []))
    _refusal(r, "part.01 is corrupt")
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize("script", ["verify.sh", "install.sh"])
def test_a_missing_part_is_refused_naming_it(parts, tmp_path, script):
    (parts / "part.02").unlink()
    r = _sh(TOOLS / script, parts, *([tmp_path / "site"] if script == "install.sh" else []))
    _refusal(r, "part.02 is missing")
    assert not (tmp_path / "site").exists()


def test_a_truncated_part_is_refused(parts):
    p = parts / "part.00"
    p.write_bytes(p.read_bytes()[:-1])
    _refusal(_sh(TOOLS / "verify.sh", parts), "part.00 is corrupt")


def test_a_part_left_out_of_the_list_is_refused(parts):
    sums = parts / "SHA256SUMS"
    lines = sums.read_text().splitlines()
    sums.write_text("\n".join(lines[:1] + lines[2:]) + "\n")
    _refusal(_sh(TOOLS / "verify.sh", parts), "part.02", "part.01 belongs")


def test_checksums_with_crlf_line_ends_are_accepted(parts, tmp_path):
    sums = parts / "SHA256SUMS"
    sums.write_bytes(sums.read_bytes().replace(b"\n", b"\r\n"))
    assert _sh(TOOLS / "verify.sh", parts).returncode == 0
    r = _sh(TOOLS / "unpack.sh", parts, tmp_path / "dest")
    assert r.returncode == 0, r.stderr


def test_a_leftover_part_is_refused(parts):
    (parts / "part.99").write_bytes(b"from another build")
    _refusal(_sh(TOOLS / "verify.sh", parts), "part.99 is not listed")


def test_missing_checksums_are_refused(parts):
    (parts / "SHA256SUMS").unlink()
    _refusal(_sh(TOOLS / "verify.sh", parts), "SHA256SUMS is missing")
    _refusal(_sh(TOOLS / "install.sh", parts), "SHA256SUMS is missing")


def test_parts_that_are_not_a_bundle_are_refused(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    (d / "part.00").write_bytes(b"not a tar archive at all" * 100)
    subprocess.run(["bash", "-c", "sha256sum part.* > SHA256SUMS"], cwd=d, check=True)
    _refusal(_sh(TOOLS / "unpack.sh", d, tmp_path / "dest"), "do not untar")


def test_install_end_to_end(parts, tmp_path):
    """verify -> join -> untar -> vllm into SITE -> wheels via pip --target -> import check."""
    site, tmp = tmp_path / "site", tmp_path / "tmp"
    tmp.mkdir()
    r = _sh(TOOLS / "install.sh", parts, site, env={"PYTHON": sys.executable, "TMPDIR": str(tmp)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "parts match SHA256SUMS" in r.stdout
    assert "vllm 0.0.fake torch 0.0.fake-torch" in r.stdout and "platform FakePlatform capability None" in r.stdout
    assert (site / "vllm" / "platforms" / "__init__.py").is_file()
    assert (site / "hyv4_fake_dep.py").read_text() == "VALUE = 42\n"
    assert not list(tmp.iterdir()), "the joined parts were not cleaned up"


def test_strip_list_is_documented_and_used():
    patterns = [line.split("#", 1)[0].strip() for line in (TOOLS / "strip.txt").read_text().splitlines()]
    patterns = [p for p in patterns if p]
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in patterns
    doc = (TOOLS / "README.md").read_text()
    for p in patterns:
        assert f"`{p}`" in doc, f"strip.txt pattern {p} is not in tools/offline-bundle/README.md"
    assert "strip.txt" in (TOOLS / "make-bundle.sh").read_text()
    wheels = [w.strip() for w in (TOOLS / "extra-wheels.txt").read_text().splitlines() if w.strip()]
    assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.]+", w) for w in wheels), "extra wheels must be pinned"


def test_readme_points_at_the_project_tooling():
    readme = (ROOT / "README.md").read_text()
    assert "tools/offline-bundle/make-bundle.sh" in readme and "tools/offline-bundle/install.sh" in readme
    assert "shared/gpu-host" not in readme
