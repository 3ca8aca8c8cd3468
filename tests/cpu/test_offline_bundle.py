"""tools/offline-bundle: pack, verify, unpack and install, on a fake bundle (no network).

The fake bundle has the real layout (bundle/vllm.tar.xz, bundle/deps.tar.xz of stored
wheels, bundle/MANIFEST, bundle/install.sh) with stand-in `vllm` and `torch` packages, two
trivial wheels and the CuTe DSL's two wheels (the real .pth line, a stand-in `cutlass`),
so the whole host-side path runs here: the venv install, the .pth taking effect, a delta
over its base. Only make-bundle.sh's download step (pip download from PyPI) is not
exercised; its pin, strip and repack steps are (pins.sh, strip.sh, stored-wheel.py).
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


def _wheel(path: pathlib.Path, name: str = "hyv4_fake_dep", version: str = "1.0",
           files: dict[str, bytes] | None = None) -> pathlib.Path:
    """A minimal valid pure-Python wheel (deflated, as published) at path/NAME-VERSION-py3-none-any.whl."""
    files = dict(files or {f"{name}.py": b"VALUE = 42\n"})
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for member, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{member},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    whl = path / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in files.items():
            z.writestr(member, data)
    return whl


# The CuTe DSL as its wheels lay it out: nvidia-cutlass-dsl ships only the .pth
# (the real line) that puts nvidia_cutlass_dsl/dsl_packages on sys.path; the
# stand-in `cutlass` there registers a cu13 `_cutlass_ir` the way the real
# loader does.
_DSL_PTH = (b"import sys, os, nvidia_cutlass_dsl; "
            b"sys.path.insert(0, os.path.join(nvidia_cutlass_dsl.__path__[0], 'dsl_packages'))\n")
_DSL_CUTLASS = (b'import sys, types\n__version__ = "4.8.0"\n'
                b'sys.modules["cutlass._mlir._mlir_libs._cutlass_ir"] = types.SimpleNamespace(\n'
                b'    __file__="/x/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so")\n')


def _dsl_wheels(deps: pathlib.Path) -> None:
    _wheel(deps, "nvidia_cutlass_dsl", "4.8.0", {"nvidia_cutlass_dsl_packages.pth": _DSL_PTH})
    _wheel(deps, "nvidia_cutlass_dsl_libs_cu13", "4.8.0", {
        "nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": _DSL_CUTLASS,
        "nvidia_cutlass_dsl/dsl_packages/cutlass/cute/__init__.py": b""})


def _stage(root: pathlib.Path, version: str = "0.0.fake", base: str | None = None,
           wheels=(("hyv4_fake_dep", "1.0"), ("hyv4_fake_other", "1.0")), dsl: bool = True,
           legacy: bool = False) -> pathlib.Path:
    """STAGE_DIR/bundle/ as make-bundle.sh leaves it, with a stand-in vllm (and torch).

    The wheels go stored (stored-wheel.py) into deps.tar.xz with a MANIFEST, as
    make-bundle.sh does; legacy=True lays them out as bundles before MANIFEST
    did (deflated, deps/*.whl, no MANIFEST)."""
    bundle = root / "bundle"
    bundle.mkdir(parents=True)
    members = {
        "vllm/__init__.py": f'__version__ = "{version}"\n'.encode(),
        "vllm/platforms/__init__.py": (b"class FakePlatform:\n    def get_device_capability(self):\n"
                                       b"        return None\n\ncurrent_platform = FakePlatform()\n"),
        # a stand-in torch too: the install check imports torch, and the real
        # import takes seconds (up to 20 s on the busy CI cores)
        "torch/__init__.py": b'__version__ = "0.0.fake-torch"\n',
        # incompressible filler so the packed tar spans several PART-byte parts
        "vllm/filler.bin": hashlib.shake_256(version.encode()).digest(30_000),
    }
    with tarfile.open(bundle / "vllm.tar.xz", "w:xz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    published = root / "published"
    published.mkdir()
    for name, ver in wheels:
        _wheel(published, name, ver, {f"{name}.py": f"VALUE = {ver!r}\n".encode()})
    if dsl:
        _dsl_wheels(published)
    deps = root / "deps"
    deps.mkdir()
    if legacy:
        shutil.copytree(published, bundle / "deps")
    else:
        r = subprocess.run([sys.executable, TOOLS / "stored-wheel.py", deps, *sorted(published.glob("*.whl"))],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        with tarfile.open(bundle / "deps.tar.xz", "w:xz") as tar:
            tar.add(deps, "deps")
        (bundle / "MANIFEST").write_text(f"vllm={version}\n" + (f"base={base}\n" if base else ""))
    shutil.copy(TOOLS / "bundle-install.sh", bundle / "install.sh")
    return root


@pytest.fixture(autouse=True)
def _store(tmp_path, monkeypatch):
    """Every install unpacks into a bundle store of the test's own (never /tmp/hyv4-bundle)."""
    monkeypatch.setenv("HYV4_BUNDLE_STORE", str(tmp_path / "store"))
    monkeypatch.delenv("HYV4_BASE_BUNDLE", raising=False)
    return tmp_path / "store"


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
        assert {"bundle/vllm.tar.xz", "bundle/install.sh", "bundle/deps.tar.xz",
                "bundle/MANIFEST"} <= set(tar.getnames())
    assert (out / "MANIFEST").read_text() == "vllm=0.0.fake\n", "the MANIFEST travels beside the parts"


def test_stored_wheels_keep_every_member_byte_for_byte(packed, tmp_path):
    """stored-wheel.py: same members, order, bytes and modes; only the deflate is gone."""
    src = _wheel(tmp_path, "hyv4_fake_dep", "1.0", {"hyv4_fake_dep.py": b"VALUE = 42\n" * 100})
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, TOOLS / "stored-wheel.py", out, src], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(out / src.name) as b:
        assert [i.filename for i in a.infolist()] == [i.filename for i in b.infolist()]
        assert all(a.read(n) == b.read(n) for n in a.namelist())
        assert [i.external_attr for i in a.infolist()] == [i.external_attr for i in b.infolist()]
        assert {i.compress_type for i in b.infolist()} == {zipfile.ZIP_STORED}
    src.write_bytes(src.read_bytes()[:-40])
    r = subprocess.run([sys.executable, TOOLS / "stored-wheel.py", out, src], capture_output=True, text=True)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and src.name in r.stderr


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
    assert ((tmp_path / "dest" / "bundle" / "vllm.tar.xz").read_bytes()
            == (stage / "bundle" / "vllm.tar.xz").read_bytes())


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
def test_a_corrupt_part_is_refused_naming_it(parts, tmp_path, script, _store):
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


def _run_in(env_dir: pathlib.Path, code: str) -> subprocess.CompletedProcess:
    """code run by ENV_DIR's own python, as the GPU commands run it: no PYTHONPATH."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(env_dir / "bin" / "python"), "-c", code], capture_output=True, text=True,
                          timeout=60, env=clean)


def _install(parts, env_dir, **env):
    return _sh(TOOLS / "install.sh", parts, env_dir, env={"PYTHON": sys.executable, **env})


@pytest.fixture(scope="module")
def jit_pack_dir(tmp_path_factory):
    """A JIT cache packed by the harness (``warmup --pack``) for the fake bundle's vLLM, in small parts."""
    from harness.ci_speed import jit_pack

    root = tmp_path_factory.mktemp("jit")
    (root / "cache" / "triton" / "k").mkdir(parents=True)
    (root / "cache" / "triton" / "k" / "kernel.so").write_bytes(os.urandom(5000))
    key = {**{f: "1" for f in jit_pack.KEY_FIELDS}, "vllm": "0.0.fake", "capability": "9.0"}
    jit_pack.write_pack(str(root / "cache"), str(root / "pack"), key, part_bytes=2048)
    return root / "pack"


def test_a_packed_jit_cache_rides_along_as_an_extra_part_set(jit_pack_dir, tmp_path):
    out = tmp_path / "bundle"
    r = _sh(TOOLS / "add-jit-cache.sh", jit_pack_dir, out, "0.0.fake")
    assert r.returncode == 0, r.stderr
    assert "added as" in r.stdout and "compute capability 9.0" in r.stdout
    assert sorted(p.name for p in (out / "jit-cache").iterdir()) == sorted(
        p.name for p in jit_pack_dir.iterdir() if not p.name.startswith("."))
    assert _sh(TOOLS / "verify.sh", out / "jit-cache").returncode == 0
    # packed for another release, or not a pack at all: refused in one line, nothing copied
    _refusal(_sh(TOOLS / "add-jit-cache.sh", jit_pack_dir, tmp_path / "b2", "0.34.0"),
             "packed with vLLM 0.0.fake, the bundle is vLLM 0.34.0")
    _refusal(_sh(TOOLS / "add-jit-cache.sh", tmp_path, tmp_path / "b2", "0.0.fake"), "not a packed JIT cache")
    assert not (tmp_path / "b2").exists()


def test_a_corrupt_part_of_the_jit_cache_is_refused_before_unpacking(parts, jit_pack_dir, tmp_path, _store):
    shutil.copytree(jit_pack_dir, parts / "jit-cache")
    p = parts / "jit-cache" / "part.01"
    p.write_bytes(p.read_bytes()[:-1])
    _refusal(_install(parts, tmp_path / "env"), "jit-cache", "part.01 is corrupt")
    assert not (tmp_path / "env").exists() and not any(_store.glob("*/"))


def test_install_end_to_end(parts, jit_pack_dir, tmp_path, _store):
    """verify -> join -> untar into the store -> venv -> vllm + stored wheels -> import check;
    the packed JIT cache beside the parts is then restored, here not (no GPU, and the bundle's
    stand-in torch: the key cannot be read), said in one line without failing the install."""
    shutil.copytree(jit_pack_dir, parts / "jit-cache")
    env_dir = tmp_path / "vllm-env"
    r = _install(parts, env_dir, HYV4_JIT_CACHE=str(tmp_path / "jit"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"^offline-bundle: the packed JIT cache was not restored \(exit \d+\): \S",
                     r.stdout, re.M), r.stdout
    assert not any((tmp_path / "jit").rglob("kernel.so"))
    # the import check wrote its bytecode into the root's bytecode layer, where the harness reads it
    assert any((tmp_path / "jit" / "pycache").rglob("vllm/__init__*.pyc")), sorted((tmp_path / "jit").rglob("*"))[:20]
    assert re.search(r"^offline-bundle: \d+ s \(parts \d+ s, environment \d+ s, JIT cache \d+ s\)$", r.stdout, re.M)
    assert "parts match SHA256SUMS" in r.stdout
    assert "vllm 0.0.fake torch 0.0.fake-torch" in r.stdout and "platform FakePlatform capability None" in r.stdout
    assert re.search(r"^cutlass-dsl 4\.8\.0 cu13 from .*nvidia_cutlass_dsl/dsl_packages/cutlass$",
                     r.stdout, re.M), r.stdout
    assert (env_dir / "pyvenv.cfg").is_file()
    assert sorted(p.name for p in _store.iterdir()) == ["0.0.fake"], "the bundle is kept, the joined parts are not"
    assert (_store / "0.0.fake" / "deps" / "hyv4_fake_dep-1.0-py3-none-any.whl").is_file()
    r = _run_in(env_dir, "import hyv4_fake_dep, vllm, cutlass, pytest; "
                         "print(hyv4_fake_dep.VALUE, vllm.__version__, cutlass.__file__)")
    assert r.returncode == 0, r.stderr
    value, version, cutlass_file = r.stdout.split()
    # the bundle's vllm wins over the host's; the host venv's packages (pytest) stay visible
    assert (value, version) == ("1.0", "0.0.fake")
    assert cutlass_file.startswith(str(env_dir)), "the .pth put the bundled DSL first on sys.path"


def test_a_reinstall_from_a_shell_with_the_env_on_path_builds_on_the_host_interpreter(parts, tmp_path, _store):
    """The usage line puts ENV_DIR/bin first on PATH; installing again from that shell must still
    build the new environment on the host's interpreter (its packages visible), not on the
    environment being replaced. PYTHON naming an interpreter inside ENV_DIR is refused in one line."""
    env_dir = tmp_path / "vllm-env"
    assert _install(parts, env_dir).returncode == 0
    path = f"{env_dir / 'bin'}:{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"
    r = _sh(TOOLS / "install.sh", parts, env_dir, env={"PATH": path, "PYTHON": "python3"})
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run_in(env_dir, "import hyv4_fake_dep, pytest; print(hyv4_fake_dep.VALUE)")
    assert r.returncode == 0 and r.stdout.split() == ["1.0"], r.stderr
    r = _install(parts, env_dir, PYTHON=str(env_dir / "bin" / "python3"))
    _refusal(r, f"PYTHON={env_dir}/bin/python3", "which this install replaces")
    assert (env_dir / "pyvenv.cfg").is_file(), "refused before anything was removed"


def _python_without_dsl() -> str:
    """This venv's base interpreter, when it has pip and no CuTe DSL of its own (else the test skips):
    a host like the GPU host, where only the bundle can bring the DSL."""
    base = pathlib.Path(sys.base_prefix) / "bin" / "python3"
    ok = base.exists() and subprocess.run(
        [str(base), "-c", "import importlib.util as u, sys; "
                          "sys.exit(u.find_spec('pip') is None or u.find_spec('nvidia_cutlass_dsl') is not None)"],
        capture_output=True).returncode == 0
    if not ok:
        pytest.skip("needs a base Python with pip and without the CuTe DSL")
    return str(base)


def test_the_dsl_pth_needs_a_site_folder_not_pythonpath(tmp_path):
    """The hole the venv closes: after pip --target SITE, SITE on PYTHONPATH never runs the DSL's .pth."""
    (tmp_path / "w").mkdir()
    _dsl_wheels(tmp_path / "w")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
                        *sorted((tmp_path / "w").glob("*.whl"))], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (site / "nvidia_cutlass_dsl_packages.pth").is_file()
    # A Python without a DSL of its own (this venv's DSL .pth would find SITE's
    # nvidia_cutlass_dsl on PYTHONPATH and activate it by accident).
    base = _python_without_dsl()
    r = subprocess.run([str(base), "-c", "import sys; print(sys.path)"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(site)})
    assert r.returncode == 0 and str(site) in r.stdout
    assert str(site / "nvidia_cutlass_dsl" / "dsl_packages") not in r.stdout


def test_an_env_dir_that_is_not_a_venv_is_not_replaced(parts, tmp_path):
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data.txt").write_text("mine")
    _refusal(_install(parts, keep), "is not a virtual environment")
    assert (keep / "data.txt").read_text() == "mine"


def test_a_bundle_without_the_cu13_dsl_is_refused_and_leaves_no_env(tmp_path):
    stage = _stage(tmp_path / "stage", dsl=False)
    assert _sh(TOOLS / "pack.sh", stage, tmp_path / "parts", PART).returncode == 0
    env_dir = tmp_path / "vllm-env"
    r = _install(tmp_path / "parts", env_dir, PYTHON=_python_without_dsl())
    _refusal(r, "the CuTe DSL", "does not import in")
    assert not env_dir.exists(), "a failed install leaves no half-built environment"


def test_a_vllm_tarball_that_does_not_unpack_is_refused_and_leaves_no_env(tmp_path):
    """vLLM is untarred beside pip's install of the wheels: its failure still fails the install,
    in one line naming the tarball, and removes the half-built environment."""
    stage = _stage(tmp_path / "stage")
    tarball = stage / "bundle" / "vllm.tar.xz"
    tarball.write_bytes(tarball.read_bytes()[: tarball.stat().st_size // 2])
    assert _sh(TOOLS / "pack.sh", stage, tmp_path / "parts", PART).returncode == 0
    env_dir = tmp_path / "vllm-env"
    r = _install(tmp_path / "parts", env_dir)
    _refusal(r, "vllm.tar.xz does not unpack: ")
    assert not env_dir.exists(), "a failed install leaves no half-built environment"


def test_parts_of_a_bundle_from_before_manifest_still_install(tmp_path):
    """deflated deps/*.whl, no MANIFEST: installed as 'unversioned'."""
    stage = _stage(tmp_path / "stage", legacy=True)
    assert _sh(TOOLS / "pack.sh", stage, tmp_path / "parts", PART).returncode == 0
    assert not (tmp_path / "parts" / "MANIFEST").exists()
    r = _install(tmp_path / "parts", tmp_path / "vllm-env")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "installed vLLM unversioned" in r.stdout


def test_a_manifest_left_from_another_build_is_refused(parts, tmp_path):
    (parts / "MANIFEST").write_text("vllm=9.9.9\n")
    _refusal(_sh(TOOLS / "unpack.sh", parts, tmp_path / "dest"), "MANIFEST is not the one packed in these parts")
    assert not (tmp_path / "dest" / "bundle").exists()


@pytest.fixture(scope="module")
def delta_parts(tmp_path_factory):
    """A delta over the 0.0.fake bundle: vLLM 0.0.fake2 and hyv4_fake_dep 2.0 only."""
    root = tmp_path_factory.mktemp("delta")
    stage = _stage(root / "stage", version="0.0.fake2", base="0.0.fake", wheels=(("hyv4_fake_dep", "2.0"),),
                   dsl=False)
    r = _sh(TOOLS / "pack.sh", stage, root / "parts", PART)
    assert r.returncode == 0, r.stderr
    return root / "parts"


def test_a_delta_is_refused_before_unpacking_when_its_base_is_not_installed(delta_parts, tmp_path, _store):
    assert (delta_parts / "MANIFEST").read_text() == "vllm=0.0.fake2\nbase=0.0.fake\n"
    env_dir = tmp_path / "vllm-env"
    r = _install(delta_parts, env_dir)
    _refusal(r, "delta over the vLLM 0.0.fake bundle", "install the 0.0.fake bundle first")
    assert not env_dir.exists() and not (_store / "0.0.fake2").exists()
    # the bundle's own install.sh (the manual route) refuses too, with the same advice
    assert _sh(TOOLS / "unpack.sh", delta_parts, tmp_path / "manual").returncode == 0
    r = _sh(tmp_path / "manual" / "bundle" / "install.sh", env_dir, env={"PYTHON": sys.executable})
    _refusal(r, "delta over the 0.0.fake bundle", "install the 0.0.fake bundle first")
    assert not env_dir.exists()


def test_a_delta_installs_over_its_base_and_both_envs_stay_usable(parts, delta_parts, tmp_path, _store):
    base_env, delta_env = tmp_path / "vllm-0.0.fake", tmp_path / "vllm-0.0.fake2"
    r = _install(parts, base_env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _install(delta_parts, delta_env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vllm 0.0.fake2 " in r.stdout and "cutlass-dsl 4.8.0 cu13" in r.stdout
    assert sorted(p.name for p in _store.iterdir()) == ["0.0.fake", "0.0.fake2"]
    probe = "import hyv4_fake_dep, hyv4_fake_other, vllm, cutlass; print(vllm.__version__, hyv4_fake_dep.VALUE)"
    # the delta's own wheel replaces the base's; the rest (hyv4_fake_other, the DSL) come from the base
    r = _run_in(delta_env, probe)
    assert r.returncode == 0 and r.stdout.split() == ["0.0.fake2", "2.0"], r.stdout + r.stderr
    r = _run_in(base_env, probe)
    assert r.returncode == 0 and r.stdout.split() == ["0.0.fake", "1.0"], r.stdout + r.stderr


def test_a_delta_installs_over_a_base_put_only_in_the_store(parts, delta_parts, tmp_path, _store):
    """A host that runs only the delta: ``--store-only`` unpacks the base's bundle into the store
    and builds no environment; the delta then installs over it as over an installed base."""
    base_env, delta_env = tmp_path / "vllm-0.0.fake", tmp_path / "vllm-0.0.fake2"
    r = _sh(TOOLS / "install.sh", "--store-only", parts, env={"PYTHON": sys.executable})
    assert r.returncode == 0 and "no environment: --store-only" in r.stdout, r.stdout + r.stderr
    assert sorted(p.name for p in _store.iterdir()) == ["0.0.fake"] and not base_env.exists()
    r = _install(delta_parts, delta_env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run_in(delta_env, "import hyv4_fake_dep, hyv4_fake_other, vllm; print(vllm.__version__, hyv4_fake_dep.VALUE)")
    assert r.returncode == 0 and r.stdout.split() == ["0.0.fake2", "2.0"], r.stdout + r.stderr
    _refusal(_sh(TOOLS / "install.sh", "--store-only", parts, base_env), "usage: install.sh --store-only PARTS_DIR")


def test_pins_lay_a_release_list_over_the_base_and_a_delta_ships_the_difference(tmp_path):
    tools = tmp_path / "tools"
    tools.mkdir()
    shutil.copy(TOOLS / "pins.sh", tools)
    (tools / "extra-wheels.txt").write_text("# base\nalpha==1.0\nBeta_Gamma==2.0  # why\ndelta==3\n")
    (tools / "extra-wheels-2.0.txt").write_text("beta-gamma==2.1\nepsilon==5\n")
    r = _sh(tools / "pins.sh", "2.0")
    assert r.returncode == 0 and r.stdout.split() == ["alpha==1.0", "beta-gamma==2.1", "delta==3", "epsilon==5"], r
    r = _sh(tools / "pins.sh", "2.0", "1.0")
    assert r.returncode == 0 and r.stdout.split() == ["beta-gamma==2.1", "epsilon==5"], r
    assert _sh(tools / "pins.sh", "1.0", "1.0").stdout == ""
    (tools / "extra-wheels-3.0.txt").write_text("zeta>=1\n")
    _refusal(_sh(tools / "pins.sh", "3.0"), "extra-wheels-3.0.txt line 1", "zeta>=1")


def test_the_real_0_34_delta_ships_the_changed_pins_but_not_huggingface_hub():
    """flashinfer-python 0.7.4 for the unserved 0.7.3; the raised filelock and tokenizers floors. Not
    huggingface_hub>=2.0: the host's transformers 5.17 refuses to import beside it (it checks <2.0)."""
    r = _sh(TOOLS / "pins.sh", "0.34.0", "0.33.0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["flashinfer-python==0.7.4", "filelock==4.2.4", "tokenizers==0.23.3"], r.stdout
    full = _sh(TOOLS / "pins.sh", "0.33.0").stdout.split()
    assert "nvidia-cutlass-dsl-libs-cu13==4.8.0" in full and "flashinfer-python==0.7.2.post1" in full


def test_strip_list_is_documented_and_used():
    patterns = [line.split("#", 1)[0].strip() for line in (TOOLS / "strip.txt").read_text().splitlines()]
    patterns = [p for p in patterns if p]
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" in patterns
    doc = (TOOLS / "README.md").read_text()
    for p in patterns:
        assert f"`{p}`" in doc, f"strip.txt pattern {p} is not in tools/offline-bundle/README.md"
    assert "strip.txt" in (TOOLS / "make-bundle.sh").read_text()
    for pins in sorted(TOOLS.glob("extra-wheels*.txt")):
        wheels = [w.split("#", 1)[0].strip() for w in pins.read_text().splitlines()]
        wheels = [w for w in wheels if w]
        assert wheels and all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.]+", w) for w in wheels), \
            f"{pins.name}: pin every wheel"


def test_readme_points_at_the_project_tooling():
    readme = (ROOT / "README.md").read_text()
    assert "tools/offline-bundle/make-bundle.sh" in readme and "tools/offline-bundle/install.sh" in readme
    assert "shared/gpu-host" not in readme
