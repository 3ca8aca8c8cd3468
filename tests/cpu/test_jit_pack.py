"""The packed JIT cache (``harness.ci_speed.jit_pack``, ``warmup --pack / --restore``), on CPU: the
key and each of its fields, a pack of another release or architecture refused and not used, a
truncated or tampered pack refused with nothing unpacked, and a restore that gives back the same
bytes, links and folders. The key is injected as a dict (a GPU host reads it from its packages
and its device); small parts, so every pack here is several of them."""

from __future__ import annotations

import os
import pathlib
import shutil
import stat
import subprocess
import sys
import types

import pytest

from harness.ci_speed import jit_cache, jit_pack
from harness.cli import main
from harness.exitcodes import CannotJudge, CLIError

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "offline-bundle"
PART = 4096  # bytes: the fake cache packs into several parts

# an SM90 host on vLLM 0.33.0 (the versions of the offline bundle's host)
HOST = {"vllm": "0.33.0", "flashinfer": "0.7.2.post1", "triton": "3.6.0", "deep_gemm": "vendored-2.8.1",
        "cutlass_dsl": "4.8.0", "tvm_ffi": "0.1.11", "humming": "0.1.19", "torch": "2.11.0+cu130",
        "cuda": "13.0", "python": "3.12", "capability": "9.0", "gpu": "NVIDIA H200"}


def _fake_cache(root: pathlib.Path) -> pathlib.Path:
    """A cache root with every layer: nested folders, binary files of several parts' size, an
    executable, an empty folder, links (to a file, to a folder, dangling inside), a stamp, and
    the layers a pack leaves out (bytecode, package map)."""
    for i, (var, sub) in enumerate(jit_cache.JIT_CACHE_LAYOUT.items()):
        d = root / sub / "mod" / "deep" / "er"
        d.mkdir(parents=True)
        (d / "kernel.so").write_bytes(os.urandom(3000 + 100 * i))  # incompressible: several parts in all
        (root / sub / "mod" / "build.ninja").write_text(f"rule {sub}\n")
    triton = root / "triton"
    (triton / "empty").mkdir()
    (triton / "run.sh").write_text("#!/bin/sh\n")
    (triton / "run.sh").chmod(0o755)
    (triton / "latest.so").symlink_to("mod/deep/er/kernel.so")
    (triton / "mod-link").symlink_to("mod")
    (triton / "gone").symlink_to("mod/no-such-file")
    (root / jit_pack.STAMP).write_text('{"versions": {"vllm": "0.33.0"}, "steps": {"tiny-k1": "f00d"}}\n')
    return root


def _tree(root: pathlib.Path, only=None) -> dict:
    """{relative path: ("dir"|"file", bytes, mode)|("link", target)} under ``root``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = pathlib.Path(dirpath) / name
            rel = str(p.relative_to(root))
            if only is not None and rel.split("/")[0] not in only:
                continue
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            else:
                out[rel] = ("file", p.read_bytes(), stat.S_IMODE(p.stat().st_mode) & 0o111)
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(cache root, pack folder) packed once for ``HOST``; tests copy the pack before changing it."""
    base = tmp_path_factory.mktemp("jit")
    root = _fake_cache(base / "cache")
    meta = jit_pack.write_pack(str(root), str(base / "pack"), HOST, PART, info={"gpu": HOST["gpu"]})
    assert int(meta["parts"]) > 3
    return root, base / "pack"


@pytest.fixture
def pack(packed, tmp_path):
    out = tmp_path / "pack"
    shutil.copytree(packed[1], out, symlinks=True)
    return out


def _layers_empty(root: pathlib.Path) -> bool:
    return not any(f for sub in jit_pack.packed_layers(str(root)).values() for _, _, f in os.walk(sub))


def test_the_key_is_every_field_and_only_those():
    key = jit_pack.cache_key(HOST)
    assert list(key) == list(jit_pack.KEY_FIELDS) and "gpu" not in key  # the GPU's name is not the architecture
    assert set(jit_pack.KEY_FIELDS) >= {"vllm", "flashinfer", "triton", "deep_gemm", "cutlass_dsl", "torch", "cuda",
                                        "capability"}
    for field in jit_pack.KEY_FIELDS:
        with pytest.raises(ValueError, match=field):
            jit_pack.cache_key({k: v for k, v in HOST.items() if k != field})
    with pytest.raises(ValueError, match="capability"):
        jit_pack.cache_key({**HOST, "capability": "9.0\nkind=x"})
    with pytest.raises(ValueError, match="vllm"):
        jit_pack.cache_key({**HOST, "vllm": "a=b"})
    assert jit_pack.key_digest(key) == jit_pack.key_digest(jit_pack.cache_key({**HOST, "gpu": "NVIDIA H100"}))


@pytest.mark.parametrize("field", list(jit_pack.KEY_FIELDS))
def test_a_change_in_any_one_field_refuses_the_pack(packed, tmp_path, field):
    root = tmp_path / "cache"
    outcome, line = jit_pack.restore(str(packed[1]), str(root), {**HOST, field: HOST[field] + "-other"})
    assert outcome == "refused" and "\n" not in line
    assert f"{field} {HOST[field]} there, {HOST[field]}-other here" in line and "not used" in line
    assert not root.exists(), "a refused pack leaves the cache root alone"


def test_another_releases_pack_is_refused_naming_what_differs(packed, tmp_path):
    here = {**HOST, "vllm": "0.34.0", "flashinfer": "0.7.4"}
    outcome, line = jit_pack.restore(str(packed[1]), str(tmp_path / "c"), here)
    assert outcome == "refused"
    assert "vllm 0.33.0 there, 0.34.0 here" in line and "flashinfer 0.7.2.post1 there, 0.7.4 here" in line


def test_another_architectures_pack_is_refused(packed, tmp_path):
    outcome, line = jit_pack.restore(str(packed[1]), str(tmp_path / "c"), {**HOST, "capability": "10.0"})
    assert outcome == "refused" and "capability 9.0 there, 10.0 here" in line


def test_restore_round_trip_gives_the_same_bytes_links_and_folders(packed, tmp_path):
    src, pack = packed
    parts = sorted(pack.glob("part.*"))
    assert all(p.stat().st_size <= PART for p in parts) and parts[-1].name == f"part.{len(parts) - 1:02d}"
    manifest = (pack / "MANIFEST").read_text()
    assert "kind=hyv4-jit-cache\n" in manifest and "capability=9.0\n" in manifest and "gpu=NVIDIA H200\n" in manifest
    root = tmp_path / "cache"
    (root / "pycache").mkdir(parents=True)
    (root / "pycache" / "mine.pyc").write_bytes(b"this host's bytecode")
    assert f"root={src}\n" in manifest  # where it was packed from: ninja's builds name that path
    import time
    t0 = time.time()
    outcome, line = jit_pack.restore(str(pack), str(root), HOST)
    assert outcome == "restored" and "restored" in line and "kept" not in line, line
    # under another root FlashInfer's builds rebuild: said; every restored file dated now (ninja
    # rebuilds outputs older than sources installed after the pack was made)
    assert f"packed from cache root {src}" in line and "rebuild" in line, line
    assert all(p.lstat().st_mtime >= t0 - 1 for p in (root / "triton").rglob("*") if not p.is_symlink())
    packed_names = set(jit_pack.packed_layers(str(src)))
    assert _tree(root, packed_names) == _tree(src, packed_names)
    assert ((root / "triton" / "latest.so").read_bytes()
            == (src / "triton" / "mod" / "deep" / "er" / "kernel.so").read_bytes())
    assert (root / "pycache" / "mine.pyc").read_bytes() == b"this host's bytecode"  # not packed, not touched
    assert not (root / "python-metadata").exists()
    import json
    stamp = json.loads((root / jit_pack.STAMP).read_text())
    assert stamp["steps"] == {"tiny-k1": "f00d"}
    assert stamp["restored"]["key"] == jit_pack.key_digest(jit_pack.cache_key(HOST))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temp folder left
    # once restored, a second restore has nothing to do
    assert jit_pack.restore(str(pack), str(root), HOST)[0] == "held"


def test_the_bundle_scripts_verify_the_pack(packed):
    r = subprocess.run(["bash", TOOLS / "verify.sh", packed[1]], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "parts match SHA256SUMS" in r.stdout, r.stderr


def test_a_layer_the_root_holds_is_kept_and_its_stamp_too(pack, tmp_path):
    root = tmp_path / "cache"
    (root / "triton").mkdir(parents=True)
    (root / "triton" / "own.bin").write_bytes(b"built here")
    (root / jit_pack.STAMP).write_text('{"versions": {}, "steps": {}}\n')
    outcome, line = jit_pack.restore(str(pack), str(root), HOST)
    assert outcome == "restored" and "kept this root's own triton" in line
    assert sorted(p.name for p in (root / "triton").iterdir()) == ["own.bin"]  # never mixed
    assert (root / "flashinfer" / "mod" / "build.ninja").is_file()
    assert (root / jit_pack.STAMP).read_text() == '{"versions": {}, "steps": {}}\n'


def _refused(pack, root, *needles):
    with pytest.raises(CLIError) as exc:
        jit_pack.restore(str(pack), str(root), HOST)
    line = str(exc.value)
    assert "\n" not in line and all(n in line for n in needles), line
    assert not root.exists() or (_layers_empty(root) and not any(p.name.startswith(".") for p in root.iterdir()))
    return line


def _flip(part: pathlib.Path, at: int) -> None:
    data = bytearray(part.read_bytes())
    data[at] ^= 0xFF
    part.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    lambda p: p.write_bytes(p.read_bytes()[:100]),  # truncated
    lambda p: _flip(p, 10),  # tampered with
])
def test_a_truncated_or_tampered_part_is_refused_and_nothing_restored(pack, tmp_path, damage):
    damage(pack / "part.02")
    _refused(pack, tmp_path / "cache", "part.02", "corrupt or truncated")


def test_a_part_tampered_with_its_checksum_too_is_refused_and_nothing_half_restored(pack, tmp_path):
    """The checksums agree, the stream does not: refused while unpacking, into a temp folder only."""
    _flip(pack / "part.02", 2000)
    subprocess.run(["bash", "-c", "sha256sum part.* > SHA256SUMS"], cwd=pack, check=True)
    root = tmp_path / "cache"
    root.mkdir()
    _refused(pack, root, "do not unpack")


@pytest.mark.parametrize("damage, needles", [
    (lambda p: (p / "part.03").unlink(), ("part.03", "missing")),
    (lambda p: shutil.copy(p / "part.00", p / "part.99"), ("part.99", "not listed")),
    (lambda p: (p / "SHA256SUMS").unlink(), ("SHA256SUMS", "missing")),
    (lambda p: (p / "SHA256SUMS").write_text("nonsense\n"), ("SHA256SUMS line 1",)),
])
def test_missing_stray_or_unlisted_parts_are_refused(pack, tmp_path, damage, needles):
    damage(pack)
    _refused(pack, tmp_path / "cache", *needles)


def _set_manifest(pack: pathlib.Path, field: str, value: str, digest: bool) -> None:
    lines = dict(line.split("=", 1) for line in (pack / "MANIFEST").read_text().splitlines())
    lines[field] = value
    if digest:
        lines["key"] = jit_pack.key_digest(jit_pack.cache_key(lines))
    (pack / "MANIFEST").write_text("".join(f"{k}={v}\n" for k, v in lines.items()))


def test_a_manifest_edited_or_swapped_is_refused(pack, tmp_path):
    _set_manifest(pack, "capability", "10.0", digest=False)
    _refused(pack, tmp_path / "cache", "MANIFEST", "not the digest of its fields")
    # a MANIFEST with a consistent digest but not the key packed inside the parts
    _set_manifest(pack, "capability", "9.0", digest=False)
    _set_manifest(pack, "torch", "2.12.0", digest=True)
    with pytest.raises(CLIError, match="is not the key packed in these parts"):
        jit_pack.restore(str(pack), str(tmp_path / "c2"), {**HOST, "torch": "2.12.0"})
    assert not any(p.name.startswith(".") for p in (tmp_path / "c2").iterdir())


@pytest.mark.parametrize("manifest, needle", [
    (None, "MANIFEST: missing"),
    ("vllm=0.33.0\n", "not a packed JIT cache"),
    ("kind=hyv4-jit-cache\nformat=9\n", "format 9"),
    ("kind=hyv4-jit-cache\nformat=1\nvllm=0.33.0\n", "needs flashinfer"),
    ("kind=hyv4-jit-cache\njunk\n", "line 2: not field=value"),
])
def test_a_folder_that_is_not_a_pack_is_refused(tmp_path, manifest, needle):
    if manifest is not None:
        (tmp_path / "MANIFEST").write_text(manifest)
    with pytest.raises(CLIError, match=needle):
        jit_pack.read_manifest(str(tmp_path))


def test_an_interrupted_restore_puts_nothing_in_place(pack, tmp_path, monkeypatch):
    """A failure among the renames moves back the layers already renamed: all or nothing."""
    root = tmp_path / "cache"
    real, calls = os.replace, []

    def flaky(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(jit_pack.os, "replace", flaky)
    with pytest.raises(OSError):
        jit_pack.restore(str(pack), str(root), HOST)
    assert _layers_empty(root) and not (root / jit_pack.STAMP).exists()
    assert not any(p.name.startswith(jit_pack.RESTORE_TMP) for p in root.iterdir())


def test_a_killed_restores_temp_folder_is_removed_by_the_next(pack, tmp_path):
    root = tmp_path / "cache"
    dead = root / f"{jit_pack.RESTORE_TMP}999999999"
    (dead / "triton").mkdir(parents=True)
    assert jit_pack.restore(str(pack), str(root), HOST)[0] == "restored"
    assert not dead.exists()


def test_the_host_key_is_read_from_the_packages_and_the_device(monkeypatch):
    """On a GPU host: the installed distributions, the vendored DeepGEMM's version, torch's CUDA
    and the device's capability (a stand-in torch here); without a CUDA device, cannot judge."""
    cuda = types.SimpleNamespace(is_available=lambda: True, get_device_capability=lambda: (9, 0),
                                 get_device_name=lambda i=0: "NVIDIA H200")
    fake = types.SimpleNamespace(__version__="2.11.0+cu130", version=types.SimpleNamespace(cuda="13.0"), cuda=cuda)
    monkeypatch.setitem(sys.modules, "torch", fake)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # put back at the end
    v = jit_pack.host_versions()
    assert "vllm" not in sys.modules  # read without importing vLLM (seconds) or DeepGEMM (its CUDA extension)
    assert (v["torch"], v["cuda"], v["capability"], v["gpu"]) == ("2.11.0+cu130", "13.0", "9.0", "NVIDIA H200")
    assert v["python"] == f"{sys.version_info[0]}.{sys.version_info[1]}"
    import importlib.metadata as md
    assert v["vllm"] == md.version("vllm") and v["flashinfer"] == md.version("flashinfer-python")
    assert v["deep_gemm"].startswith("vendored-") or v["deep_gemm"] == jit_pack.ABSENT
    assert list(jit_pack.cache_key(v)) == list(jit_pack.KEY_FIELDS)
    cuda.is_available = lambda: False
    with pytest.raises(CannotJudge, match="no CUDA device"):
        jit_pack.host_versions()


# ---- the command line ----

@pytest.fixture
def cli_env(monkeypatch):
    monkeypatch.delenv(jit_cache.JIT_CACHE_ENV, raising=False)
    monkeypatch.setenv("HYV4_MODEL_INFO_PREFETCH", "0")


@pytest.mark.parametrize("argv, culprit", [
    (["--restore-only"], "--restore-only needs --restore"),
    (["--restore", "{pack}", "--restore-only", "--pack", "{tmp}/p2", "--cache", "{tmp}/c"],
     "--restore-only and --pack"),
    (["--restore", "{pack}"], "--restore needs one cache root"),
    (["--restore", "{tmp}/nowhere", "--cache", "{tmp}/c"], "--restore {tmp}/nowhere: no such directory"),
    (["--restore", "{tmp}", "--cache", "{tmp}/c"], "MANIFEST: missing"),
    (["--pack", "{tmp}/c", "--cache", "{tmp}/c"], "inside the cache root"),
    (["--pack", "{tmp}/p2", "--cache", "{tmp}/c", "--part-bytes", "10"], "--part-bytes 10"),
])
def test_bad_restore_and_pack_flags_exit_2_in_one_line(pack, tmp_path, capsys, cli_env, argv, culprit):
    argv = [a.format(pack=pack, tmp=tmp_path) for a in argv]
    assert main(["warmup", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit.format(tmp=tmp_path) in err[0] and "Traceback" not in err[0], err


def test_a_corrupt_pack_given_to_warmup_exits_2_before_anything_runs(pack, tmp_path, capsys, cli_env, monkeypatch):
    from harness.ci_speed import warmup

    (pack / "part.01").write_bytes(b"x")
    monkeypatch.setattr(jit_pack, "host_versions", lambda: dict(HOST))
    monkeypatch.setattr(warmup, "run", lambda *a, **k: pytest.fail("warmup ran on a corrupt pack"))
    assert main(["warmup", "--restore", str(pack), "--cache", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "part.01" in err[0] and "corrupt or truncated" in err[0]


def test_restore_only_without_a_gpu_cannot_judge(pack, tmp_path, capsys, cli_env, monkeypatch):
    def no_gpu():
        raise CannotJudge("the JIT cache key needs the GPU's compute capability: no CUDA device here")
    monkeypatch.setattr(jit_pack, "host_versions", no_gpu)
    assert main(["warmup", "--restore", str(pack), "--restore-only", "--cache", str(tmp_path / "c")]) == 125
    cap = capsys.readouterr()
    assert "cannot judge: " in cap.out + cap.err and "no CUDA device" in cap.out + cap.err
    assert "Traceback" not in cap.out + cap.err
    assert not (tmp_path / "c").exists(), sorted((tmp_path / "c").rglob("*"))


@pytest.mark.parametrize("capability, outcome", [("9.0", "restored"), ("10.0", "refused")])
def test_restore_only_restores_or_says_why_not(pack, tmp_path, capsys, cli_env, monkeypatch, capability, outcome):
    import json

    monkeypatch.setattr(jit_pack, "host_versions", lambda: {**HOST, "capability": capability})
    report = tmp_path / "w.json"
    assert main(["warmup", "--restore", str(pack), "--restore-only", "--cache", str(tmp_path / "c"),
                 "--report", str(report)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("warmup: "), out
    assert json.loads(report.read_text())["restore"]["outcome"] == outcome
    assert ("capability 9.0 there, 10.0 here" in out[0]) == (outcome == "refused")
    assert _layers_empty(tmp_path / "c") == (outcome == "refused")


def test_a_refused_pack_is_not_used_and_warmup_compiles_as_usual(pack, tmp_path, capsys, cli_env, monkeypatch):
    from harness.ci_speed import warmup

    ran = []
    monkeypatch.setattr(jit_pack, "host_versions", lambda: {**HOST, "vllm": "0.34.0"})
    monkeypatch.setattr(warmup, "run", lambda args, log=print: ran.append(args) or {
        "steps": [], "skipped_warm": [], "seconds": 1.0, "cache_root": None})
    assert main(["warmup", "--restore", str(pack), "--cache", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert ran and "vllm 0.33.0 there, 0.34.0 here" in out and "not used" in out
    assert _layers_empty(tmp_path / "c")


def test_warmup_pack_writes_the_parts_for_this_hosts_key(packed, tmp_path, capsys, cli_env, monkeypatch):
    from harness.ci_speed import warmup

    src = packed[0]
    monkeypatch.setattr(jit_pack, "host_versions", lambda: dict(HOST))
    monkeypatch.setattr(warmup, "run", lambda args, log=print: {
        "steps": [], "skipped_warm": ["tiny-k1"], "seconds": 1.0, "cache_root": str(src), "size_before": 1,
        "size_after": 1})
    dest = tmp_path / "pack"
    assert main(["warmup", "--if-cold", "--cache", str(src), "--pack", str(dest), "--part-bytes", "65536"]) == 0
    out = capsys.readouterr().out
    assert f"packed {dest}: 1 parts" in out and "vLLM 0.33.0 on compute capability 9.0" in out, out
    assert jit_pack.read_manifest(str(dest))["capability"] == "9.0"
    assert jit_pack.restore(str(dest), str(tmp_path / "again"), HOST)[0] == "restored"


# ---- benchmarks/bench_jit_pack.py (measured on a GPU host; here its refusal and its table) ----

def _bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_jit_pack", ROOT / "benchmarks" / "bench_jit_pack.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_benchmark_cannot_judge_without_a_gpu_and_refuses_bad_arguments(tmp_path, capsys, monkeypatch):
    from harness.production import can_run

    bench = _bench()
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: [])
    assert bench.main(["--out", str(tmp_path / "o"), "--env", f"0.33.0={sys.prefix}"]) == 125
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("cannot judge: no NVIDIA GPU")
    assert bench.main(["--out", str(tmp_path / "o"), "--env", "0.33.0"]) == 2
    assert "want RELEASE=PATH" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_benchmark_table_gives_each_figure_and_the_ratio(capsys):
    res = {"0.33.0": {"install": {"rc": 0, "seconds": 41.0},
                      "pack": {"rc": 0, "seconds": 144.0, "parts": 4, "bytes": 180_000_000, "files": 900,
                               "key": {"vllm": "0.33.0", "capability": "9.0"}},
                      "bare": {"rc": 0, "seconds": 165.0}, "restore": {"rc": 0, "seconds": 6.0},
                      "restored": {"rc": 0, "seconds": 21.0, "jit_files_compiled": 0},
                      "refused-0.34.0": {"refused": True}}}
    _bench().print_table(res, link_mb_s=100)
    out = capsys.readouterr().out
    assert "pack 4 parts, 180.0 MB, 900 files" in out and "install 41.0 s" in out
    assert "without the pack: bisect-check 165.0 s  -> first verdict 206.0 s" in out
    # 1.8 s transfer + 6 + 21 + 41 = 69.8 s
    assert "first verdict 69.8 s  (0.34x of without; target met)" in out
    assert "compiled by bisect-check after the restore: 0" in out and "0.34.0's pack here: refused" in out


# ---- ninja (FlashInfer's JIT builds) finds a restored build up to date ------------------------------

def _ninja() -> str:
    try:
        import ninja
    except ImportError:
        pytest.skip("the ninja package (a vLLM dependency) is not installed in this environment")
    return os.path.join(ninja.BIN_DIR, "ninja")


def _ninja_plan(ninja: str, build: pathlib.Path) -> str:
    """What ninja would do in ``build`` (a dry run), with its reasons."""
    res = subprocess.run([ninja, "-n", "-d", "explain", "-C", str(build), "-f", str(build / "build.ninja")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout + res.stderr


def test_a_restored_ninja_build_is_up_to_date_though_its_sources_were_installed_after_the_pack(tmp_path):
    """FlashInfer's builds as ninja sees them: a compile rule with a gcc depfile (``deps = gcc``: the
    header lands in .ninja_deps) over an installed source and a generated one in the cache, and a
    link. After the pack, the 'installed' sources are written again (a fresh host installs them
    after the pack was made); the pack restored into its root, emptied, must leave ninja nothing to
    do. Dating the restored files now alone (leaving the logs' times) is what rebuilt FlashInfer's
    modules on a GPU host: ninja wants to rebuild then, so this test can fail."""
    ninja = _ninja()
    site = tmp_path / "site"  # the installed library: a source and a header outside the cache
    site.mkdir()
    (site / "k.cu").write_text("kernel\n")
    (site / "k.h").write_text("header\n")
    root = tmp_path / "jit"
    build = root / "flashinfer" / ".cache" / "flashinfer" / "mod"
    gen = root / "flashinfer" / ".cache" / "flashinfer" / "generated"
    build.mkdir(parents=True)
    gen.mkdir()
    (gen / "g.cu").write_text("generated\n")
    (build / "build.ninja").write_text(
        "rule cc\n"
        f"  command = cat $in > $out && printf '%s: %s\\n' $out {site / 'k.h'} > $out.d\n"
        "  depfile = $out.d\n  deps = gcc\n"
        "rule link\n  command = cat $in > $out\n"
        f"build {build / 'k.o'}: cc {site / 'k.cu'}\n"
        f"build {build / 'g.o'}: cc {gen / 'g.cu'}\n"
        f"build {build / 'mod.so'}: link {build / 'k.o'} {build / 'g.o'}\n")
    subprocess.run([ninja, "-C", str(build)], check=True, capture_output=True, timeout=60)
    assert "no work to do" in _ninja_plan(ninja, build)
    pack = tmp_path / "pack"
    jit_pack.write_pack(str(root), str(pack), HOST, PART)
    shutil.rmtree(root)
    for f in site.iterdir():  # installed after the pack was made
        f.write_text(f.read_text())
    outcome, line = jit_pack.restore(str(pack), str(root), HOST)
    assert outcome == "restored", line
    plan = _ninja_plan(ninja, build)
    assert "no work to do" in plan, plan
    # the files alone dated now, the logs' times as packed: ninja rebuilds (stale deps / log)
    for p in (root / "flashinfer").rglob("*"):
        os.utime(p)
    (site / "k.h").write_text("header\n")
    plan = _ninja_plan(ninja, build)
    assert "no work to do" not in plan, plan


def test_the_pack_names_its_python_environment_and_a_restore_under_another_says_it_rebuilds(packed, tmp_path):
    src, pack = packed
    manifest = (pack / jit_pack.MANIFEST).read_text()
    assert f"prefix={sys.prefix}\n" in manifest
    other = tmp_path / "pack"
    shutil.copytree(pack, other)
    text = (other / jit_pack.MANIFEST).read_text().replace(f"prefix={sys.prefix}\n", "prefix=/elsewhere/venv\n")
    (other / jit_pack.MANIFEST).write_text(text)
    outcome, line = jit_pack.restore(str(other), str(tmp_path / "root"), HOST)
    assert outcome == "restored" and "packed under the Python environment /elsewhere/venv" in line, line


@pytest.mark.parametrize("gpu", [True, False])
def test_restore_only_compiles_the_bytecode_layer_beside_the_restore(pack, tmp_path, capsys, cli_env, monkeypatch,
                                                                     gpu):
    """The install's restore (``--restore-only``) also fills the root's bytecode layer, so the
    first GPU command finds it warm; its line stays the last. A restore that cannot be done
    leaves no root it made behind, bytecode included."""
    import json

    from harness.ci_speed import jit_cache

    def no_gpu():
        raise CannotJudge("the JIT cache key needs the GPU's compute capability: no CUDA device here")
    monkeypatch.setattr(jit_pack, "host_versions", (lambda: dict(HOST)) if gpu else no_gpu)
    monkeypatch.setattr(jit_cache, "PRECOMPILE_PACKAGES", ("json",))  # small and always there
    monkeypatch.setattr(jit_cache, "PRECOMPILE_MIN_CPUS", 1)
    monkeypatch.delenv(jit_cache.BYTECODE_VAR, raising=False)
    root = tmp_path / "c"
    code = main(["warmup", "--restore", str(pack), "--restore-only", "--cache", str(root)])
    cap = capsys.readouterr()
    if not gpu:
        assert code == 125 and not root.exists(), sorted(root.rglob("*"))[:10]
        return
    assert code == 0
    assert cap.out.strip().splitlines()[-1].startswith("warmup: ") and "restored" in cap.out
    assert "bytecode: compiled 1 package dir(s)" in cap.err
    assert any((root / "pycache").rglob("json/decoder*.pyc"))
    assert list(json.loads((root / "pycache" / jit_cache.PRECOMPILED).read_text())) == [
        os.path.dirname(json.__file__)]
    assert not _layers_empty(root)
