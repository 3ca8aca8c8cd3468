"""The exit-code contract over eleven classes of hostile input (beside ``test_exit_contract.py``).

1 outputs that are not regular files, 2 an empty or ``-`` CKPT_DIR, 3 bad input checked before
any GPU question, 4 bad input that used to be "unexpected" (125), 5 ``harness.ci_speed``'s
``xdist_schedule`` and ``pytest_timeline``, 6 ``synth --force``'s swap, 7 signals and dead runs'
leftovers, 8 upper bounds, 9 vLLM model directories, 10 the documented environment variables,
11 messages that name the culprit. Each bad input is exit 2 with one line naming the flag, variable, key,
tensor or file, nothing written; the commands run in process on a host made to look like a
GPU host whose production path fails the test if reached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from test_exit_contract import _run  # the exit-code tests' one CLI runner (tests/cpu on sys.path)

ROOT = Path(__file__).resolve().parents[2]


# gpu_host and tiny_ckpt: tests/cpu/conftest.py (shared with test_bad_input_round4.py)


def _one_line(result, want_code, *culprits):
    code, lines, text = result
    assert code == want_code, text
    assert len(lines) == 1 and "Traceback" not in text, text
    for c in culprits:
        assert str(c) in lines[0], f"{c!r} not named in: {lines[0]}"
    return lines[0]


def _tree(p: Path) -> dict:
    """{relative path: (kind, bytes)} of everything under ``p`` (links not followed)."""
    out = {}
    for x in sorted(p.rglob("*")):
        st = os.lstat(x)
        out[str(x.relative_to(p))] = (stat.S_IFMT(st.st_mode),
                                      x.read_bytes() if stat.S_ISREG(st.st_mode) else None)
    return out


def _special(tmp: Path, kind: str) -> Path:
    p = tmp / f"special-{kind}"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        s.close()
    else:  # a character device like /dev/null, made here (root only)
        try:
            os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("mknod needs root")
    return p


# ---- 1: an output that is not a regular file is refused, never replaced --------------------------

OUTPUT_COMMANDS = {
    "reference": lambda t: ["reference", "preset:tiny", "--tokens", "2", "--out", t],
    "compare": lambda t: ["compare", "--report", t],
    "bisect-check": lambda t: ["bisect-check", "--report", t],
    "main": lambda t: ["main", "--report", t],
    "report-plot": lambda t: ["report", "{good}", "--plot", t],
    "mutants": lambda t: ["mutants", "--report", t],
    "mutants-speculator": lambda t: ["mutants", "--speculator", "--report", t],
    "warmup": lambda t: ["warmup", "--report", t],
    "warmup-pack": lambda t: ["warmup", "--cache", "{tmp}/c", "--pack", t],
}


def _good_report(tmp: Path) -> Path:
    p = tmp / "good.json"
    p.write_text(json.dumps({"meta": {}, "cases": {"c": {"components": [
        {"name": "step0.logits", "passed": True, "max_abs": 1e-6, "max_rel": 1e-6, "similarity_gap": 0.0}]}}}))
    return p


@pytest.mark.parametrize("kind", ["fifo", "socket", "device"])
@pytest.mark.parametrize("command", sorted(OUTPUT_COMMANDS))
def test_non_regular_output_is_refused(command, kind, tmp_path, capsys, gpu_host):
    target = _special(tmp_path, kind)
    good = _good_report(tmp_path)
    argv = [str(a).format(good=good, tmp=tmp_path) for a in OUTPUT_COMMANDS[command](target)]
    before = _tree(tmp_path)
    line = _one_line(_run(capsys, *argv), 2, str(target))
    assert line.startswith("error: ") and ("FIFO" in line or "socket" in line or "device node" in line)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "file"])
def test_synth_out_dir_that_is_not_a_directory(kind, tmp_path, capsys):
    target = _special(tmp_path, kind) if kind != "file" else tmp_path / "a-file"
    if kind == "file":
        target.write_text("x")
    before = _tree(tmp_path)
    _one_line(_run(capsys, "synth", target, "--force"), 2, str(target), "not a directory")
    assert _tree(tmp_path) == before


def test_schedule_destination_that_is_special(tmp_path, capsys):
    from harness.ci_speed import xdist_schedule as schedule

    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="tests.gpu.test_a" name="t" time="1.5"/></testsuite>')
    fifo = _special(tmp_path, "fifo")
    before = _tree(tmp_path)
    _one_line(_run(capsys, junit, fifo, "run", main=schedule.main), 2, "FIFO")
    assert _tree(tmp_path) == before


def test_the_writer_itself_refuses_and_follows_links(tmp_path):
    """``harness.atomic`` is the one writer: a special file is refused there too (whatever
    the command checked), a link to a regular file writes that file and keeps the link, a link
    to nowhere is refused."""
    from harness.atomic import NotRegularFile, atomic_write_bytes, write_failure
    from harness.exitcodes import classify

    fifo = _special(tmp_path, "fifo")
    with pytest.raises(NotRegularFile) as ei:
        atomic_write_bytes(fifo, b"x")
    assert classify(write_failure(f"--out {fifo}", ei.value))[0] == 2
    code, line = classify(ei.value)  # raised by a write no argument check foresaw: still bad input
    assert code == 2 and line == f"error: {fifo}: is a FIFO; refusing to replace it with a file"
    os.symlink(fifo, tmp_path / "to-fifo")
    with pytest.raises(NotRegularFile):
        atomic_write_bytes(tmp_path / "to-fifo", b"x")
    (tmp_path / "real.json").write_text("old")
    os.symlink(tmp_path / "real.json", tmp_path / "link.json")
    atomic_write_bytes(tmp_path / "link.json", b"new")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    os.symlink(tmp_path / "nowhere" / "x", tmp_path / "dangling")
    with pytest.raises(NotRegularFile):
        atomic_write_bytes(tmp_path / "dangling", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link.json", "real.json", "special-fifo",
                                                          "to-fifo"]


# ---- 2: an empty or "-" CKPT_DIR is refused --------------------------------------------------------

@pytest.mark.parametrize("ckpt, culprit", [("", "CKPT_DIR is empty"), ("  ", "CKPT_DIR is empty"),
                                           ("-", "CKPT_DIR '-'")])
@pytest.mark.parametrize("command", ["reference", "compare", "main"])
def test_empty_checkpoint_argument(command, ckpt, culprit, tmp_path, capsys, gpu_host):
    argv = [command, ckpt] + (["--out", tmp_path / "t.safetensors"] if command == "reference"
                              else ["--report", tmp_path / "r.json"])
    _one_line(_run(capsys, *argv), 2, culprit)
    assert list(tmp_path.iterdir()) == []


# ---- 3: every argument and variable checked before the GPU question ------------------------------

def _bad_before_gpu_cases(tmp: Path):
    f = tmp / "afile"
    f.write_text("x")
    return [
        (["compare", "--report", f / "r.json"], {}, ["--report", "not a directory"]),
        (["bisect-check", "--report", f / "r.json"], {}, ["--report"]),
        (["main", "--report", f / "r.json"], {}, ["--report"]),
        (["mutants", "--report", f / "r.json"], {}, ["--report"]),
        (["mutants", "--speculator", "--report", tmp], {}, ["--report", "is a directory"]),
        (["mutants", "--speculator", "--budget-s", "-5"], {}, ["--budget-s"]),
        (["mutants", "--budget-s", "nan"], {}, ["--budget-s"]),
        (["compare", "engine-accept-k3-share", "--tp", "2"], {}, ["--tp 2", "engine-accept-k3-share"]),
        (["warmup", "--cache", f], {}, ["--cache", "not a directory"]),
        (["warmup", "--cache", f / "sub"], {}, ["--cache"]),
        (["warmup", "--lanes", "100000"], {}, ["--lanes"]),
        (["compare"], {"HYV4_JIT_CACHE": str(f)}, ["$HYV4_JIT_CACHE", "not a directory"]),
        (["bisect-check"], {"HYV4_SPECULATOR_MUTANT": "bogus"}, ["$HYV4_SPECULATOR_MUTANT", "bogus"]),
        (["bisect-check"], {"HYV4_ENGINE_KV_CACHE_GIB": "lots"}, ["$HYV4_ENGINE_KV_CACHE_GIB", "lots"]),
        (["bisect-check"], {"HYV4_ENGINE_KV_CACHE_GIB": "-1"}, ["$HYV4_ENGINE_KV_CACHE_GIB"]),
        (["compare"], {"HYV4_REPORT_DIR": str(f)}, ["$HYV4_REPORT_DIR"]),
        (["compare"], {"HYV4_REFERENCE_DEVICE": "tpu"}, ["$HYV4_REFERENCE_DEVICE", "tpu"]),
        (["compare"], {"HYV4_PACKAGE_MAP_CACHE": str(f)}, ["$HYV4_PACKAGE_MAP_CACHE"]),
    ]


def test_bad_input_is_answered_before_the_gpu_question(tmp_path, capsys, gpu_host, monkeypatch):
    for argv, env, culprits in _bad_before_gpu_cases(tmp_path):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            before = _tree(tmp_path)
            line = _one_line(_run(capsys, *argv), 2, *culprits)
            assert line.startswith("error: "), (argv, line)
            assert _tree(tmp_path) == before, argv


def test_engine_command_checks_its_outputs_and_variables_first(tmp_path, capsys, monkeypatch):
    from harness.production import can_run
    from harness.commands.engine import main as engine_main

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    f = tmp_path / "afile"
    f.write_text("x")
    _one_line(_run(capsys, "--case", "engine-accept-k3-share", "--out", f / "x", main=engine_main), 2, "--out")
    _one_line(_run(capsys, "--rejudge", "", main=engine_main), 2, "--rejudge is empty")
    monkeypatch.setenv("HYV4_REPORT_DIR", str(f))
    _one_line(_run(capsys, "--case", "engine-accept-k3-share", main=engine_main), 2, "$HYV4_REPORT_DIR")
    monkeypatch.delenv("HYV4_REPORT_DIR")
    monkeypatch.setenv("HYV4_SPECULATOR_MUTANT", "bogus")
    line = _one_line(_run(capsys, "--case", "engine-accept-k3-share", main=engine_main), 2,
                     "$HYV4_SPECULATOR_MUTANT")
    assert "--mutant" not in line  # the flag nobody gave is not blamed


# ---- 4 and 11: bad files and values named, not "unexpected harness error" -----------------------

def _config_edit(fn):
    def edit(d: Path):
        hf = json.loads((d / "config.json").read_text())
        fn(hf)
        (d / "config.json").write_text(json.dumps(hf))
    return edit


def _deep(n: int) -> str:
    return "[" * n + "]" * n


def _write_header(f: Path, raw: bytes) -> None:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _header_entry(d: Path, field: str, value) -> None:
    f = d / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    hdr = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])
    hdr[sorted(k for k in hdr if k != "__metadata__")[0]][field] = value
    _write_header(f, json.dumps(hdr, separators=(",", ":")).encode())


def _lying_header(d: Path):
    """The first shard's header says one tensor is F32 where it is stored as BF16 (span too small)."""
    f = d / "model-00001-of-00002.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    hdr = json.loads(data[8:8 + n])
    name = sorted(k for k, v in hdr.items() if k != "__metadata__" and v["dtype"] == "BF16")[-1]
    hdr[name]["dtype"] = "F32"
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    assert len(raw) <= n
    raw += b" " * (n - len(raw))
    f.write_bytes(data[:8] + raw[:n] + data[8 + n:])
    return name


CHECKPOINT_EDITS = {
    "config-nested-deep": (lambda d: (d / "config.json").write_text(_deep(100_000)), ["config.json"]),
    "index-nested-deep": (lambda d: (d / "model.safetensors.index.json").write_text(_deep(100_000)),
                          ["model.safetensors.index.json"]),
    "shard-header-nested-deep": (lambda d: _write_header(d / "model-00002-of-00002.safetensors",
                                                           _deep(100_000).encode()),
                                 ["model-00002-of-00002.safetensors"]),
    "config-fifo": (lambda d: ((d / "config.json").unlink(), os.mkfifo(d / "config.json")), ["config.json"]),
    "index_topk-huge": (_config_edit(lambda hf: hf.__setitem__("index_topk", 10 ** 30)), ["index_topk", "<="]),
    "hidden-401-digits": (_config_edit(lambda hf: hf.__setitem__("hidden_size", 10 ** 400)), ["hidden_size"]),
    "config-too-big": (lambda d: (d / "config.json").write_text(
        json.dumps({**json.loads((d / "config.json").read_text()), "pad": "x" * (17 << 20)})),
                       ["config.json", "bytes"]),
    "rope_theta-401-digits": (_config_edit(lambda hf: hf.__setitem__("rope_theta", 10 ** 400)), ["rope_theta"]),
    "rms_norm_eps-huge-int": (_config_edit(lambda hf: hf.__setitem__("rms_norm_eps", 10 ** 30)), ["rms_norm_eps"]),
    "beta_fast-null": (_config_edit(lambda hf: hf.__setitem__("rope_parameters", {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": None})),
                       ["beta_fast"]),
    "shard-dtype-list": (lambda d: _header_entry(d, "dtype", ["BF16"]), ["dtype"]),
    "rope_type-list": (_config_edit(lambda hf: hf.__setitem__("rope_parameters", {"rope_type": ["yarn"]})),
                       ["rope_type"]),
    "factor-string": (_config_edit(lambda hf: hf.__setitem__(
        "rope_parameters", {"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 4096})),
                      ["factor"]),
}


@pytest.mark.parametrize("edit", sorted(CHECKPOINT_EDITS))
@pytest.mark.parametrize("command", ["reference", "compare"])
def test_bad_checkpoint_files_are_named(command, edit, tiny_ckpt, tmp_path, capsys, gpu_host):
    mutate, culprits = CHECKPOINT_EDITS[edit]
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    mutate(d)
    out = tmp_path / "out" / "t"
    argv = [command, d, "--out" if command == "reference" else "--report", out]
    line = _one_line(_run(capsys, *argv), 2, *culprits)
    assert line.startswith("error: ") and len(line) < 1000
    assert not (tmp_path / "out").exists()


def test_a_lying_shard_header_names_its_tensor(tiny_ckpt, tmp_path, capsys, gpu_host):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    name = _lying_header(d)
    _one_line(_run(capsys, "compare", d), 2, name, "dtype")


def test_an_output_never_replaces_an_input(tiny_ckpt, tmp_path, capsys, gpu_host):
    from harness.ci_speed import xdist_schedule as schedule

    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    good = _good_report(tmp_path)
    before = _tree(tmp_path)
    _one_line(_run(capsys, "reference", d, "--out", d / "model-00001-of-00002.safetensors"), 2, "would replace")
    _one_line(_run(capsys, "compare", d, "--report", d / "config.json"), 2, "would replace")
    _one_line(_run(capsys, "report", good, "--plot", good), 2, "--plot", "would replace")
    _one_line(_run(capsys, "warmup", "--cache", tmp_path, "--pack", tmp_path / "jit.tar.gz"), 2, "--pack")
    _one_line(_run(capsys, good, good, "r", main=schedule.main), 2, "would replace")
    assert _tree(tmp_path) == before


def test_report_files_that_are_hostile(tmp_path, capsys):
    deep = tmp_path / "deep.json"
    deep.write_text(_deep(100_000))
    big = tmp_path / "big.json"
    big.write_text(_good_report(tmp_path).read_text().replace("1e-06", "1" * 401, 1))
    digits = tmp_path / "digits.json"
    digits.write_text(_good_report(tmp_path).read_text().replace("step0.logits", "step" + "9" * 5000 + ".x"))
    surrogate = tmp_path / "surrogate.json"
    surrogate.write_text(_good_report(tmp_path).read_text().replace("step0.logits", "\\udcff"))
    for p in (deep, big, surrogate):
        _one_line(_run(capsys, "report", p), 2, p.name)
    assert _run(capsys, "report", digits, digits)[0] == 0
    _one_line(_run(capsys, "report", tmp_path), 2, "is a directory")


@pytest.mark.parametrize("argv, culprit", [
    (["reference", "preset:tiny", "--seed", str(2 ** 64), "--out", "{tmp}/t.safetensors"], "--seed"),
    (["reference", "preset:tiny", "--seed", "-1", "--out", "{tmp}/t.safetensors"], "--seed"),
    (["synth", "{tmp}/ck", "--seed", str(2 ** 64)], "--seed"),
    (["compare", "--seed", str(2 ** 64)], "--seed"),
    (["reference", "preset:tiny", "--out", "{tmp}/" + "n" * 300], "bytes"),
    (["reference", "preset:tiny", "--out", ""], "--out is empty"),
    (["compare", "--report", ""], "--report is empty"),
    (["synth", ""], "OUT_DIR is empty"),
    (["synth", ".", "--force"], "the current directory"),
    (["synth", "/", "--force"], "OUT_DIR /: is /"),
    (["reference", "{tmp}/" + "c" * 300, "--out", "{tmp}/t.safetensors"], "CKPT_DIR"),
    (["compare", "{tmp}/" + "c" * 300], "CKPT_DIR"),
    (["reference", "preset:tiny", "--out", "/proc/1/t.safetensors"], "--out /proc/1/t.safetensors"),
])
def test_bad_values_name_their_flag(argv, culprit, tmp_path, capsys, gpu_host):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    _one_line(_run(capsys, *argv), 2, culprit)
    assert list(tmp_path.iterdir()) == []


def test_a_truncated_recording_is_bad_input(tmp_path, capsys):
    from harness.commands.engine import main as engine_main
    from harness.production.engine.recording import RECORDING_FORMAT

    (tmp_path / "engine_calls_engine-accept-k3-share.json").write_text(json.dumps(
        {"format": RECORDING_FORMAT, "call_meta": [], "proposal_meta": [], "meta": {}}))
    (tmp_path / "engine_calls_engine-accept-k3-share.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    code, lines, text = _run(capsys, "--rejudge", tmp_path, main=engine_main)
    assert code == 2 and "Traceback" not in text, text
    assert any("engine_calls_engine-accept-k3-share" in ln and "not a readable engine recording" in ln
               for ln in lines), text


# ---- 5: harness.ci_speed.xdist_schedule and pytest_timeline follow the contract ------------------

def test_schedule_bad_input(tmp_path, capsys):
    from harness.ci_speed import xdist_schedule as schedule

    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="tests.gpu.test_a" name="t" time="1.5"/></testsuite>')
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    cases = [([junit, tmp_path / "adir", "r"], "is a directory"),
             ([junit, tmp_path / "afile" / "d.json", "r"], "not a directory"),
             ([tmp_path / "adir", tmp_path / "d.json", "r"], "not a regular file"),
             ([tmp_path / "nope.xml", tmp_path / "d.json", "r"], "no such file"),
             ([tmp_path / "afile", tmp_path / "d.json", "r"], "not a pytest JUnit file"),
             ([junit], "usage")]
    before = _tree(tmp_path)
    for argv, culprit in cases:
        _one_line(_run(capsys, *argv, main=schedule.main), 2, culprit)
    assert _tree(tmp_path) == before
    assert _run(capsys, junit, tmp_path / "d.json", "r", main=schedule.main)[0] == 0
    assert json.loads((tmp_path / "d.json").read_text())["seconds"] == {"tests/gpu/test_a.py::t": 1.5}


@pytest.mark.parametrize("make, culprit", [
    (lambda d: (d / "w.jsonl").mkdir(), "w.jsonl"),
    (lambda d: os.symlink(d / "nowhere", d / "w.jsonl"), "w.jsonl"),
    (lambda d: (d / "w.jsonl").write_bytes(b'{"who": "w\xff"}\n'), "UTF-8"),
])
def test_timeline_bad_files(make, culprit, tmp_path, capsys):
    from harness.ci_speed import pytest_timeline as timeline

    make(tmp_path)
    _one_line(_run(capsys, tmp_path, main=timeline.main), 2, culprit)


def test_timeline_huge_numbers_are_not_records(tmp_path, capsys):
    from harness.ci_speed import pytest_timeline as timeline

    (tmp_path / "w.jsonl").write_text(json.dumps({"who": "w", "event": "process", "t": 10 ** 400}) + "\n"
                                      + json.dumps({"who": "w", "event": "end", "t": 5.0}) + "\n")
    code, lines, text = _run(capsys, tmp_path, main=timeline.main)
    assert code == 0 and "Traceback" not in text, text
    _one_line(_run(capsys, tmp_path / "nope", main=timeline.main), 2, "usage")


# ---- 6: synth --force: the message matches what happened ----------------------------------------

def test_synth_force_when_the_old_checkpoint_cannot_be_removed(tmp_path, capsys, monkeypatch):
    from harness import atomic

    out = tmp_path / "ck"
    assert _run(capsys, "synth", out)[0] == 0
    real_unlink = Path.unlink

    def unlink(self, *a, **kw):  # an immutable file in the replaced directory
        if ".old-" in str(self) and self.name == "config.json":
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_unlink(self, *a, **kw)

    monkeypatch.setattr(atomic.Path, "unlink", unlink)
    code, lines, text = _run(capsys, "synth", out, "--force", "--seed", "3")
    assert code == 0, text
    warn = [ln for ln in lines if ln.startswith("warning:")]
    assert len(warn) == 1 and f"ck.old-{os.getpid()}" in warn[0] and "written" in warn[0], text
    assert "config.json" in warn[0]
    assert (out / "config.json").is_file() and "Traceback" not in text


def test_a_directory_write_through_a_link_replaces_the_directory_it_points_at(tmp_path):
    from harness.atomic import atomic_write_dir

    real = tmp_path / "real"
    atomic_write_dir(real, lambda d: (d / "old.safetensors").write_text("old"))
    os.symlink(real, tmp_path / "link")
    atomic_write_dir(tmp_path / "link", lambda d: (d / "config.json").write_text("{}"), replace=True)
    assert (tmp_path / "link").is_symlink()
    assert sorted(p.name for p in real.iterdir()) == [".hyv4-harness-written.json", "config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    with pytest.raises(FileExistsError, match="not empty"):
        atomic_write_dir(tmp_path / "link", lambda d: None)


# ---- 7: signals and the leftovers of dead runs ----------------------------------------------------

@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")])
def test_a_signal_mid_write_leaves_nothing(sig, code, word, tmp_path, capsys):
    from harness.atomic import atomic_write, atomic_write_dir
    from harness.exitcodes import run_guarded

    def killed(tmp):
        Path(tmp).write_bytes(b"half")
        os.kill(os.getpid(), sig)

    # a signal this process inherited as ignored (a background job's SIGINT) stays ignored by
    # design: give the test the dispositions an interactive run has
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert run_guarded(lambda: atomic_write(tmp_path / "deep" / "t.safetensors", killed)) == code
        assert run_guarded(lambda: atomic_write_dir(tmp_path / "ck", lambda d: killed(d / "config.json"))) == code
        # run_guarded put back the handlers it found
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    out, err = capsys.readouterr()
    lines = [ln for ln in (out + err).splitlines() if ln.strip()]
    assert lines == [f"interrupted ({word}): nothing half-written is left"] * 2
    assert list(tmp_path.iterdir()) == []


def test_sigint_of_a_real_entry_point_is_one_line(tmp_path):
    """An entry point interrupted mid-write (``python -m harness ci schedule``, no
    torch): one line, 130, no traceback, no temp file."""
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, harness.atomic as a\n"
        "w = a.atomic_write\n"
        "def k(path, write):\n"
        "    return w(path, lambda tmp: (write(tmp), os.kill(os.getpid(), signal.SIGINT)))\n"
        "a.atomic_write = k\n")
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="tests.gpu.test_a" name="t" time="1.5"/></testsuite>')
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    r = subprocess.run([sys.executable, "-m", "harness", "ci", "schedule", str(junit), str(tmp_path / "d.json"), "r"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                       # SIGINT as an interactive shell leaves it (a background job inherits it ignored)
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == 130 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["interrupted (SIGINT): nothing half-written is left"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["j.xml", "sitecustomize.py"]


def test_leftovers_of_dead_runs_are_cleaned(tmp_path):
    from harness.atomic import _write_marker, atomic_write_bytes, atomic_write_dir

    dead = 2 ** 22 + 12345  # above the default pid_max: never a live process
    live = os.getppid()
    (tmp_path / f".t.json.{dead}.abcd1234.tmp").write_text("half")
    (tmp_path / f".t.json.{live}.abcd1234.tmp").write_text("a live run's")
    (tmp_path / f"ck.tmp-{dead}").mkdir()
    _write_marker(tmp_path / f"ck.tmp-{dead}")  # the harness marks its temp directory first thing
    # the swap had finished: the old one (written by the harness, its marker says) is only debris
    atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text("{}"))
    atomic_write_dir(tmp_path / "x", lambda d: (d / "config.json").write_text("{}"))
    os.rename(tmp_path / "x", tmp_path / f"ck.old-{dead}")
    atomic_write_bytes(tmp_path / "t.json", b"{}")
    atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text('{"new": 1}'), replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f".t.json.{live}.abcd1234.tmp", "ck", "t.json"])
    assert (tmp_path / "ck" / "config.json").read_text() == '{"new": 1}'
    # killed between the two renames of a swap: the old directory goes back, and is not replaced
    # without --force
    atomic_write_dir(tmp_path / "gone", lambda d: (d / "config.json").write_text("{}"))
    os.rename(tmp_path / "gone", tmp_path / f"gone.old-{dead}")
    with pytest.raises(FileExistsError, match="not empty"):
        atomic_write_dir(tmp_path / "gone", lambda d: None)
    assert (tmp_path / "gone" / "config.json").read_text() == "{}"


# ---- 8: upper bounds, stated ----------------------------------------------------------------------

@pytest.mark.parametrize("argv, culprit", [
    (["reference", "preset:tiny", "--requests", "1000000000"], "--requests"),
    (["reference", "preset:tiny", "--tokens", "100000000"], "--tokens"),
    (["reference", "preset:tiny", "--tokens", "8200", "--requests", "1"], "max_position_embeddings 8192"),
    (["reference", "preset:real-dims", "--tokens", "4096", "--requests", "2"], "hidden_size 2816"),
    (["reference", "preset:tiny", "--steps", "100000"], "--steps"),
    (["reference", "preset:tiny", "--tp", "100000"], "--tp"),
    (["synth", "{tmp}/ck", "--mtp-layers", "100000"], "--mtp-layers"),
    (["synth", "{tmp}/ck", "--vocab-size", str(10 ** 12)], "--vocab-size"),
    (["synth", "{tmp}/ck", "--preset", "real-dims", "--mtp-layers", "2"], "2**31"),
    (["synth", "{tmp}/ck", "--shards", "100000"], "--shards"),
    (["compare", "--tp", "1000"], "--tp"),
    (["compare", "--steps", "100000"], "--steps"),
])
def test_counts_are_bounded_above(argv, culprit, tmp_path, capsys, gpu_host):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if argv[0] == "reference":
        argv += ["--out", str(tmp_path / "t.safetensors")]
    line = _one_line(_run(capsys, *argv), 2, culprit)
    assert any(w in line for w in ("..", "<=", "max_position_embeddings", "2**24", "2**31"))  # the bound stated
    assert list(tmp_path.iterdir()) == []


# ---- 9: vLLM model directories do not outlive their process -------------------------------------

def test_model_directories_are_removed(tmp_path, monkeypatch):
    import tempfile

    from harness.production import process_temp
    from harness.production.module.vllm_config import write_model_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(process_temp, "_process_temp", [])
    dead = tmp_path / f"{process_temp.PROCESS_TEMP_PREFIX}{2 ** 22 + 54321}"
    dead.mkdir()
    path = write_model_dir({"model_type": "x"})
    assert Path(path, "config.json").is_file() and not dead.exists()
    process_temp.remove_process_temp_dir()
    assert list(tmp_path.iterdir()) == []
    parents = tmp_path / "a-parent's"  # inherited through a fork: the parent's to remove, not the child's
    parents.mkdir()
    monkeypatch.setattr(process_temp, "_process_temp", [(os.getpid() + 1, str(parents))])
    process_temp.remove_process_temp_dir()
    assert parents.is_dir()


def test_a_folder_whose_owner_holds_its_lock_is_kept_whatever_its_pid(tmp_path, monkeypatch):
    """A temp folder of a live process in another PID namespace (its pid means nothing here) is
    kept while its owner lock is held, and removed by the next run once it is not."""
    import subprocess
    import sys
    import tempfile

    from harness.production import process_temp

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(process_temp, "_process_temp", [])
    other = tmp_path / f"{process_temp.PROCESS_TEMP_PREFIX}{2 ** 22 + 54322}"  # no such pid here
    other.mkdir()
    (other / "config.json").write_text("{}")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"),
        str(other / process_temp.OWNER_LOCK)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        process_temp.process_temp_dir()
        assert (other / "config.json").is_file()  # owned: kept
    finally:
        holder.communicate("")
    process_temp.remove_process_temp_dir()
    process_temp.process_temp_dir()  # the next run: the lock is free, the folder goes
    assert not other.exists()
    process_temp.remove_process_temp_dir()


# ---- 10: the documented environment variables ---------------------------------------------------

@pytest.mark.parametrize("name, value, culprit", [
    ("HYV4_TIMELINE", "{file}", "not a directory"),
    ("HYV4_REFERENCE_DEVICE", "tpu", "tpu"),
    ("HYV4_GOLDENS_ROOT", "{tmp}/goldnes", "no such directory"),
    ("HYV4_PYTEST_WORKERS", "many", "many"),
    ("HYV4_MODEL_INFO_PREFETCH", "off", "off"),
])
def test_documented_variables_are_checked(name, value, culprit, tmp_path):
    from harness.exitcodes import CLIError
    from harness.input_checks import ENVIRONMENT, environment

    (tmp_path / "f").write_text("x")
    value = value.format(file=tmp_path / "f", tmp=tmp_path)
    assert name in ENVIRONMENT
    with pytest.raises(CLIError) as ei:
        environment(env={name: value})
    assert f"${name}" in str(ei.value) and culprit in str(ei.value) and "\n" not in str(ei.value)


def test_pytest_and_with_env_refuse_bad_variables_in_one_line(tmp_path):
    """A test run with a bad documented variable is a usage error (no INTERNALERROR), and
    ``./with-env`` refuses a cache that is a file (exit 2) before building anything."""
    import sys

    (tmp_path / "f").write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "--co", "tests/cpu/test_schedule.py"],
                       cwd=ROOT, env={**env, "HYPOTHESIS_PROFILE": "bogus"}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 4 and "INTERNALERROR" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "HYPOTHESIS_PROFILE" in r.stdout + r.stderr
    r = subprocess.run([str(ROOT / "with-env"), "true"], env={**env, "HYV4_ENV_CACHE": str(tmp_path / "f")},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "HYV4_ENV_CACHE" in r.stderr, r.stderr


def test_a_mistyped_goldens_root_is_named(tmp_path, monkeypatch):
    from harness.goldens import store

    monkeypatch.setenv("HYV4_GOLDENS_ROOT", str(tmp_path))
    monkeypatch.setattr(store, "ROOT", tmp_path)
    with pytest.raises(store.GoldenError) as ei:
        store.load("reference", "c1", root=tmp_path)
    assert "HYV4_GOLDENS_ROOT" in str(ei.value) and "--update-goldens" not in str(ei.value)
