"""The exit-code contract over round 4's eight classes of hostile input (beside round 3's file).

1 ``synth --force`` removes only what the harness wrote (its marker), one writer at a time, a file
written into OUT meanwhile survives; 2 an explicit target on a host without the production path is
validated, then 125 (never the goldens' 0); 3 every terminating signal is 128 + n in one line, the
swap whole, dead runs' leftovers cleaned; 4 config values outside the domain their use gives them;
5 bad input that was 125 (a name too long, Python's int-string limit) and a full or closed stdout;
6 reads that block or exhaust memory (FIFOs, ``/dev/zero``, a shard truncated mid-read); 7 checks
before the GPU question (a trailing slash, /proc, an empty goldens root, a negative error); 8
messages that name the culprit (header offsets, what a shard is) without harming the terminal
(control characters escaped, long lists cut). The commands run in process; two run as programs
(a signal and a full stdout need a process of their own).
"""

from __future__ import annotations

import json
import os
import signal
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_bad_input_round3 import _good_report, _one_line, _special, _tree  # gpu_host, tiny_ckpt: conftest.py
from test_exit_contract import _run

ROOT = Path(__file__).resolve().parents[2]
MARKER = ".hyv4-harness-written.json"


@pytest.fixture
def cpu_host(monkeypatch):
    """A host without the production path, whatever this one has; the goldens check must not run
    for an explicit target."""
    from harness.goldens import reference as golden_reference
    from harness.production import can_run

    def must_not_run(*a, **kw):
        raise AssertionError("the goldens check answered for an explicit target")

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    monkeypatch.setattr(golden_reference, "check_reference_goldens", must_not_run)


# ---- 1: synth --force never removes what the harness did not write --------------------------------

def _home(d: Path) -> Path:
    (d / ".ssh").mkdir(parents=True)
    (d / ".ssh" / "id_ed25519").write_text("secret")
    (d / "notes.txt").write_text("notes")
    return d


def _git_repo(d: Path) -> Path:
    (d / ".git").mkdir(parents=True)
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (d / "src.py").write_text("print(1)\n")
    return d


@pytest.mark.parametrize("make, culprit", [(_home, ".ssh"), (_git_repo, ".git")])
def test_force_refuses_a_directory_the_harness_did_not_write(make, culprit, tmp_path, capsys):
    d = make(tmp_path / "d")
    before = _tree(tmp_path)
    line = _one_line(_run(capsys, "synth", d, "--force"), 2, str(d), culprit, MARKER)
    assert line.startswith("error: ")
    assert _tree(tmp_path) == before


def test_force_replaces_its_own_checkpoint_but_not_a_file_added_to_it(tmp_path, capsys):
    out = tmp_path / "ck"
    assert _run(capsys, "synth", out)[0] == 0
    assert MARKER in os.listdir(out)
    assert _run(capsys, "synth", out, "--force", "--seed", "2")[0] == 0  # all of it the harness's: replaced
    (out / "mine.txt").write_text("mine")
    before = _tree(tmp_path)
    _one_line(_run(capsys, "synth", out, "--force"), 2, "mine.txt", "did not write")
    assert _tree(tmp_path) == before
    os.unlink(out / MARKER)  # a checkpoint without the marker (written by hand, or by another tool)
    (out / "mine.txt").unlink()
    _one_line(_run(capsys, "synth", out, "--force"), 2, MARKER, "config.json")


def test_a_file_written_into_out_during_the_write_is_never_deleted(tmp_path):
    from harness.atomic import InTheWay, atomic_write_dir

    out = tmp_path / "ck"
    atomic_write_dir(out, lambda d: (d / "config.json").write_text("old"))

    def fill(d: Path) -> None:
        (d / "config.json").write_text("new")
        (out / "yours.txt").write_text("written meanwhile")  # someone else, into OUT, mid-write

    with pytest.raises(InTheWay, match="yours.txt"):
        atomic_write_dir(out, fill, replace=True)
    assert (out / "yours.txt").read_text() == "written meanwhile" and (out / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp directory, no lock file


def test_a_file_that_lands_in_the_replaced_directory_stays(tmp_path, monkeypatch, capsys):
    """Between the last check and the swap: the replaced directory loses only the harness's files."""
    from harness import atomic

    out = tmp_path / "ck"
    atomic.atomic_write_dir(out, lambda d: (d / "config.json").write_text("old"))
    real_replace = atomic.os.replace

    def replace(src, dst):
        if str(dst).endswith(f".old-{os.getpid()}"):
            (Path(src) / "late.txt").write_text("late")
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    atomic.atomic_write_dir(out, lambda d: (d / "config.json").write_text("new"), replace=True)
    old = tmp_path / f"ck.old-{os.getpid()}"
    assert sorted(p.name for p in old.iterdir()) == ["late.txt"] and (out / "config.json").read_text() == "new"
    assert "late.txt" in capsys.readouterr().err


def test_two_writers_of_one_out_are_serialised(tmp_path, capsys):
    from harness.atomic import atomic_write_dir

    out = tmp_path / "ck"
    seen = {}

    def fill(d: Path) -> None:  # a second synth starts while this write is under way
        seen["second"] = _run(capsys, "synth", out)
        (d / "config.json").write_text("first")

    atomic_write_dir(out, fill)
    code, lines, text = seen["second"]
    assert code == 2 and len(lines) == 1 and f"pid {os.getpid()}" in lines[0] and "writing it now" in lines[0], text
    assert (out / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


# ---- 2: an explicit target on a host without the production path ----------------------------------

def _rewrite_header(f: Path, edit) -> None:
    """Replace the JSON header of safetensors file ``f`` by ``edit(header text)`` (data kept)."""
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    raw = edit(data[8:8 + n].decode()).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _first_entry(text: str) -> tuple[dict, str]:
    hdr = json.loads(text)
    name = sorted(k for k in hdr if k != "__metadata__")[0]
    return hdr, name


def _listed_twice(text: str) -> str:
    hdr, name = _first_entry(text)
    dup = json.dumps({name: hdr[name]})[1:-1]
    return text.rstrip()[:-1] + ", " + dup + "}"


@pytest.mark.parametrize("target, code, culprit", [
    ("{ck}", 125, "CKPT_DIR"),
    ("engine-accept-k3-share", 125, "engine-accept-k3-share"),
    ("preset:tiny", 125, "preset:tiny"),
    ("{dup}", 2, "listed twice"),
    ("{bigpos}", 125, "CKPT_DIR"),
    ("{nope}", 2, "nope"),
])
def test_main_with_an_explicit_target_judges_it_or_says_it_cannot(target, code, culprit, tiny_ckpt, tmp_path, capsys,
                                                                   cpu_host):
    dup = shutil.copytree(tiny_ckpt, tmp_path / "dup")
    _rewrite_header(dup / "model-00001-of-00002.safetensors", _listed_twice)
    big = shutil.copytree(tiny_ckpt, tmp_path / "bigpos")
    hf = json.loads((big / "config.json").read_text())
    hf["max_position_embeddings"] = 2 ** 31 - 1
    (big / "config.json").write_text(json.dumps(hf))
    arg = target.format(ck=tiny_ckpt, dup=dup, bigpos=big, nope=tmp_path / "nope")
    line = _one_line(_run(capsys, "main", arg), code, culprit)
    assert line.startswith("cannot judge: " if code == 125 else "error: ")
    if code == 125:
        assert "no CUDA device" in line


def test_main_flags_alone_make_the_target_explicit(capsys, cpu_host):
    _one_line(_run(capsys, "main", "--steps", "3"), 125, "--steps 3", "no CUDA device")
    _one_line(_run(capsys, "main", "--tp", "3"), 2, "--tp 3")  # tiny's heads do not split in three


# ---- 3: every terminating signal, the swap, dead runs' leftovers ----------------------------------

SIGNALS = [s for s in ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGTERM", "SIGINT", "SIGXCPU")
           if hasattr(signal, s)]


@pytest.fixture
def default_signals():
    """The dispositions an interactive run has (a background job inherits SIGINT ignored)."""
    from harness.exitcodes import terminating_signals

    before = {s: signal.getsignal(s) for s in terminating_signals()}
    for s in before:
        signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)


@pytest.mark.parametrize("name", SIGNALS)
def test_every_terminating_signal_is_one_line_and_leaves_nothing(name, tmp_path, capsys, default_signals):
    from harness.atomic import atomic_write, atomic_write_dir
    from harness.exitcodes import run_guarded

    sig = getattr(signal, name)

    def killed(tmp):
        Path(tmp).write_bytes(b"half")
        os.kill(os.getpid(), sig)

    assert run_guarded(lambda: atomic_write(tmp_path / "deep" / "t.safetensors", killed)) == 128 + sig
    assert run_guarded(lambda: atomic_write_dir(tmp_path / "ck", lambda d: killed(d / "config.json"))) == 128 + sig
    assert signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler)  # handlers put back
    out, err = capsys.readouterr()
    assert [ln for ln in (out + err).splitlines() if ln.strip()] == [
        f"interrupted ({name}): nothing half-written is left"] * 2
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signal_during_the_swap_waits_for_it(name, tmp_path, monkeypatch, capsys, default_signals):
    """Sent between the two renames (from another thread, as torch's threads would take it): the new
    directory is installed whole, the old one removed, then 128 + n."""
    import threading

    from harness import atomic
    from harness.exitcodes import run_guarded

    sig = getattr(signal, name)
    out = tmp_path / "ck"
    atomic.atomic_write_dir(out, lambda d: (d / "config.json").write_text("old"))
    real_replace = atomic.os.replace

    def replace(src, dst):
        if str(dst).endswith(f".old-{os.getpid()}"):
            t = threading.Thread(target=os.kill, args=(os.getpid(), sig))
            t.start()
            t.join()
        return real_replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    code = run_guarded(lambda: atomic.atomic_write_dir(out, lambda d: (d / "config.json").write_text("new"),
                                                       replace=True))
    assert code == 128 + sig
    assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert capsys.readouterr().err.strip() == f"interrupted ({name}): nothing half-written is left"


def test_sighup_of_a_real_entry_point(tmp_path):
    """A program (``python -m harness ci schedule``, no torch) hung up mid-write: 129,
    one line, no temp file."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, harness.atomic as a\n"
        "w = a.atomic_write\n"
        "def k(path, write):\n"
        "    return w(path, lambda tmp: (write(tmp), os.kill(os.getpid(), signal.SIGHUP)))\n"
        "a.atomic_write = k\n")
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuite><testcase classname="tests.gpu.test_a" name="t" time="1.5"/></testsuite>')
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    r = subprocess.run([sys.executable, "-m", "harness", "ci", "schedule", str(junit), str(tmp_path / "d.json"),
                        "r"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    assert r.returncode == 129 and "Traceback" not in r.stderr, (r.returncode, r.stderr)
    assert r.stderr.strip().splitlines() == ["interrupted (SIGHUP): nothing half-written is left"], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["j.xml", "sitecustomize.py"]


def test_dead_runs_leftovers_go_but_a_foreign_file_stays(tmp_path):
    from harness.atomic import _write_marker, atomic_write_bytes, atomic_write_dir

    dead = 2 ** 22 + 4321  # above the default pid_max: never a live process
    (tmp_path / f".t.json.{dead}.x1y2z3w4.tmp").write_text("half")
    (tmp_path / f"ck.tmp-{dead}").mkdir()
    _write_marker(tmp_path / f"ck.tmp-{dead}")  # the harness marks its temp directory first thing
    (tmp_path / f"ck.tmp-{dead}" / "config.json").write_text("half")
    (tmp_path / f"ck.tmp-{dead + 1}").mkdir()  # a directory of that name the harness did not make
    (tmp_path / f"ck.tmp-{dead + 1}" / "yours.txt").write_text("yours")
    atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text("{}"))
    atomic_write_dir(tmp_path / "x", lambda d: (d / "config.json").write_text("{}"))
    (tmp_path / "x" / "yours.txt").write_text("not the harness's")
    os.rename(tmp_path / "x", tmp_path / f"ck.old-{dead}")
    atomic_write_bytes(tmp_path / "t.json", b"{}")
    atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text("{}"), replace=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", f"ck.old-{dead}", f"ck.tmp-{dead + 1}", "t.json"]
    assert sorted(p.name for p in (tmp_path / f"ck.old-{dead}").iterdir()) == ["yours.txt"]
    assert (tmp_path / f"ck.tmp-{dead + 1}" / "yours.txt").read_text() == "yours"


# ---- 4: config values outside their domain ---------------------------------------------------------

def _yarn(**kw):
    return {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, **kw}}


def _fp8(**kw):
    return {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], **kw}}


DOMAIN_CASES = {
    "yarn factor 0": (_yarn(factor=0), "rope_parameters.factor", "> 0"),
    "yarn factor -4": (_yarn(factor=-4), "rope_parameters.factor", "> 0"),
    "yarn original max 0": (_yarn(original_max_position_embeddings=0), "original_max_position_embeddings", ">= 1"),
    "top original max 0": ({**_yarn(), "original_max_position_embeddings": 0}, "original_max_position_embeddings",
                           ">= 1"),
    "rope_theta 0": ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta", "> 1"),
    "rope_theta -10000": ({"rope_parameters": {"rope_theta": -10000}}, "rope_theta", "> 1"),
    "rope_theta true": ({"rope_parameters": {"rope_theta": True}}, "rope_theta", "true / false"),
    "top rope_theta 1": ({"rope_theta": 1}, "rope_theta", "> 1"),
    "top rope_theta true": ({"rope_theta": True}, "rope_theta", "> 1"),
    "beta_fast 0": (_yarn(beta_fast=0), "beta_fast", "> 0"),
    "beta_slow -1": (_yarn(beta_slow=-1), "beta_slow", "> 0"),
    "mscale -1": (_yarn(mscale=-1.0, mscale_all_dim=1.0), "mscale", ">= 0"),
    "mscale_all_dim -10": ({"rope_parameters": {"rope_type": "deepseek_yarn", "factor": 4.0, "mscale_all_dim": -10.0,
                                                "original_max_position_embeddings": 4096}}, "mscale_all_dim", ">= 0"),
    "attention_factor 0": (_yarn(attention_factor=0), "attention_factor", "> 0"),
    "factor true": (_yarn(factor=True), "rope_parameters.factor", "true / false"),
    "modules_to_not_convert [5]": (_fp8(modules_to_not_convert=[5]), "modules_to_not_convert", "string"),
    "ignored_layers a string": (_fp8(ignored_layers="lm_head"), "ignored_layers", "list of strings"),
    "exclude_modules [null]": ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8_PB_WO",
                                                        "exclude_modules": [None]}}, "exclude_modules", "string"),
    "weight_block_size [true, 128]": (_fp8(weight_block_size=[True, 128]), "weight_block_size", "two ints"),
    "weight_block_size [0, 128]": (_fp8(weight_block_size=[0, 128]), "weight_block_size", "two ints"),
    "scale_fmt 5": (_fp8(scale_fmt=5), "scale_fmt", "string"),
}


@pytest.mark.parametrize("case", sorted(DOMAIN_CASES))
def test_config_values_outside_their_domain_are_named(case):
    from harness.presets import preset
    from reference.config import ConfigError, MTPConfig

    edit, key, allowed = DOMAIN_CASES[case]
    with pytest.raises(ConfigError) as err:
        MTPConfig.from_hf_dict({**preset("tiny"), **edit})
    assert key in str(err.value) and allowed in str(err.value), str(err.value)


def test_every_numeric_key_refuses_a_bool_and_a_value_below_its_domain():
    """Derived from the tables the checks read: each numeric key the reference uses, given true or a
    value under its lower bound, is refused naming the key."""
    from harness.presets import preset
    from reference.config import _ROPE_DOMAIN, ConfigError, MTPConfig
    from reference.config_checks import FLOAT_FIELDS, INT_FIELDS

    tiny = preset("tiny")
    edits = []
    for key, low in INT_FIELDS.items():
        edits += [(key, {key: True}), (key, {key: low - 1})]
    for key, bound in FLOAT_FIELDS.items():
        edits.append((key, {key: True}))
        if bound is not None:
            edits.append((key, {key: bound[0] - 1.0}))
    for key, (low, _, _, _) in _ROPE_DOMAIN.items():
        params = {"rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
        edits += [(key, {"rope_parameters": {**params, key: True}}),
                  (key, {"rope_parameters": {**params, key: int(low) - 1}})]
    for key, edit in edits:
        with pytest.raises(ConfigError) as err:
            MTPConfig.from_hf_dict({**tiny, **edit})
        assert key in str(err.value), (edit, str(err.value))


def test_a_config_outside_its_domain_is_bad_input_for_the_cli(tiny_ckpt, tmp_path, capsys, gpu_host):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    hf = json.loads((d / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": [5]}
    (d / "config.json").write_text(json.dumps(hf))
    _one_line(_run(capsys, "reference", d, "--out", tmp_path / "t.safetensors"), 2, "modules_to_not_convert")
    hf.pop("quantization_config")
    hf["rope_parameters"] = {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 4096}
    (d / "config.json").write_text(json.dumps(hf))
    _one_line(_run(capsys, "compare", d), 2, "rope_parameters.factor", "> 0")
    assert not (tmp_path / "t.safetensors").exists()


# ---- 5: a name too long, Python's int-string limit, stdout full or closed --------------------------

def test_names_too_long_are_bad_input(tmp_path, capsys, gpu_host):
    long_name = tmp_path / ("b" * 300)
    deep = tmp_path / "/".join(["d" * 200] * 22)  # past PATH_MAX (4096)
    for argv, culprit in [(["bisect-check", "--record-baseline", long_name], "--record-baseline"),
                          (["bisect-check", "--baseline", long_name], "--baseline"),
                          (["bisect-check", "--record-baseline", deep], "--record-baseline"),
                          (["bisect-check", "--baseline", deep], "--baseline")]:
        _one_line(_run(capsys, *argv), 2, culprit)
    assert list(tmp_path.iterdir()) == []


def test_an_oserror_about_a_path_is_bad_input_wherever_it_is_raised():
    import errno

    from harness.exitcodes import classify

    code, line = classify(OSError(errno.ENAMETOOLONG, "File name too long", "/x/" + "y" * 5000))
    assert code == 2 and "File name too long" in line and len(line) < 400


def test_a_baseline_manifest_past_the_int_string_limit(tmp_path, capsys, gpu_host):
    d = tmp_path / "bl"
    d.mkdir()
    (d / "manifest.json").write_text('{"cases": {}, "baseline": {"platform": {}, "cases": [], "n": '
                                     + "9" * 5000 + "}}")
    _one_line(_run(capsys, "bisect-check", "--baseline", d), 2, "manifest.json", "4300 digits")


class _Broken:
    def __init__(self, err):
        self.err = err

    def write(self, s):
        raise OSError(self.err, os.strerror(self.err))

    def flush(self):
        raise OSError(self.err, os.strerror(self.err))


@pytest.mark.parametrize("err, code", [("ENOSPC", 2), ("EPIPE", 141), ("EIO", 2)])
def test_a_stdout_that_cannot_be_written(err, code, monkeypatch, capsys):
    import errno

    from harness.exitcodes import run_guarded

    monkeypatch.setattr(sys, "stdout", _Broken(getattr(errno, err)))

    def command():
        print("a verdict")
        return 0

    assert run_guarded(command) == code
    err_text = capsys.readouterr().err
    if code == 141:
        assert err_text == ""  # a reader that went away: quiet, as other tools end
    else:
        assert err_text.startswith("error: stdout: cannot write: ") and len(err_text.splitlines()) == 1


def test_stdout_to_dev_full_and_a_closed_pipe_end_in_one_line_or_quietly(tmp_path):
    """``python -m harness ci timeline DIR`` (no torch) prints a table to stdout."""
    (tmp_path / "main.jsonl").write_text(json.dumps({"who": "main", "event": "process", "t": 1.0}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "harness", "ci", "timeline", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("process"), (r.stdout, r.stderr)
    with open("/dev/full", "w") as full:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: stdout: cannot write: No space left on device"], r.stderr
    read, write = os.pipe()
    os.close(read)  # `| head -c0`
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert r.returncode == 141 and r.stderr == "", r.stderr


# ---- 6: reads that would block or exhaust memory ---------------------------------------------------

def test_a_fifo_recording_is_refused_not_waited_for(tmp_path, capsys):
    from harness.commands.engine import main as engine_main

    os.mkfifo(tmp_path / "engine_calls_engine-accept-k3-share.json")
    (tmp_path / "engine_calls_engine-accept-k3-share.safetensors").write_bytes(b"")
    code, lines, text = _run(capsys, "--rejudge", tmp_path, main=engine_main)
    assert code == 2 and "Traceback" not in text and any("FIFO" in ln for ln in lines), text


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_timeline_that_is_no_file(kind, tmp_path, capsys):
    from harness.ci_speed import pytest_timeline as timeline

    if kind == "fifo":
        os.mkfifo(tmp_path / "w.jsonl")
    else:
        os.symlink("/dev/zero", tmp_path / "w.jsonl")
    _one_line(_run(capsys, tmp_path, main=timeline.main), 2, "w.jsonl",
              "FIFO" if kind == "fifo" else "device node")


def test_a_shard_truncated_while_it_is_read_is_named(tiny_ckpt, tmp_path, monkeypatch):
    """No memory map: the shard shrinks after its header was checked, and the read says so (the
    mmapped read this replaces died of SIGBUS)."""
    from harness.checkpoint import loader
    from harness.checkpoint.errors import CheckpointError

    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    real = loader._Reader.read

    def truncated_first(self, name):
        h, path = self._handle(name)
        if not getattr(self, "cut", False):
            os.truncate(path, h.data_start + 16)
            self.cut = True
        return real(self, name)

    monkeypatch.setattr(loader._Reader, "read", truncated_first)
    with pytest.raises(CheckpointError, match="changed while it was read") as err:
        loader.load_checkpoint(d)
    assert err.value.tensor and ".safetensors" in err.value.file


def test_bounded_reads_refuse_special_and_oversized_files(tmp_path):
    from harness.exitcodes import CLIError
    from harness.input_checks import read_bytes, read_json

    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2048)
    for path, why in [("/dev/zero", "device node"), (_special(tmp_path, "fifo"), "FIFO"), (tmp_path, "directory"),
                      (big, "more than the 1024")]:
        with pytest.raises(CLIError, match=why):
            read_bytes("X", path, 1024)
    (tmp_path / "n.json").write_text("[" + "1" * 5000 + "]")
    with pytest.raises(CLIError, match="4300"):
        read_json("n.json", tmp_path / "n.json")


# ---- 7: checked before the GPU question ------------------------------------------------------------

def test_checked_before_the_gpu_question(tmp_path, capsys, monkeypatch):
    """On this host (no CUDA: a check after the GPU question would say 125)."""
    for argv, culprit in [
        (["bisect-check", "--record-baseline", "/proc/x"], "--record-baseline /proc/x"),
        (["mutants", "--report", f"{tmp_path}/newdir/"], "ends with /"),
        (["reference", "preset:tiny", "--tokens", "2", "--out", f"{tmp_path}/new.out/"], "ends with /"),
        (["compare", "--report", f"{tmp_path}/r.json/"], "ends with /"),
    ]:
        _one_line(_run(capsys, *argv), 2, culprit)
    assert list(tmp_path.iterdir()) == []


def test_an_empty_goldens_root_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYV4_GOLDENS_ROOT", str(tmp_path))
    _one_line(_run(capsys, "main"), 2, "$HYV4_GOLDENS_ROOT", "manifest.json")


@pytest.mark.parametrize("field", ["max_abs", "max_rel"])
def test_a_report_with_a_negative_error(field, tmp_path, capsys):
    p = _good_report(tmp_path)
    doc = json.loads(p.read_text())
    doc["cases"]["c"]["components"][0][field] = -1.0
    p.write_text(json.dumps(doc))
    _one_line(_run(capsys, "report", p), 2, field, ">= 0")


# ---- 8: messages that name the culprit and do not harm the terminal --------------------------------

def _entry_edit(fn):
    def edit(text: str) -> str:
        hdr, name = _first_entry(text)
        fn(hdr, name)
        return json.dumps(hdr)
    return edit


def _overlap(hdr, name):
    """The last tensor's span moved 2 bytes down, over its neighbour's (its own size kept)."""
    last = max((k for k in hdr if k != "__metadata__"), key=lambda k: hdr[k]["data_offsets"][0])
    hdr[last]["data_offsets"] = [o - 2 for o in hdr[last]["data_offsets"]]


OFFSET_EDITS = {
    "negative": (_entry_edit(lambda h, n: h[n].__setitem__("data_offsets", [-8, h[n]["data_offsets"][1]])),
                 "data_offsets start -8"),
    "float": (_entry_edit(lambda h, n: h[n].__setitem__("data_offsets", [h[n]["data_offsets"][0] + 0.5,
                                                                           h[n]["data_offsets"][1]])),
              "data_offsets start"),
    "string": (_entry_edit(lambda h, n: h[n].__setitem__("data_offsets", [str(h[n]["data_offsets"][0]),
                                                                            h[n]["data_offsets"][1]])),
               "data_offsets start"),
    "overlap": (_entry_edit(_overlap), "overlap"),
    "one offset": (_entry_edit(lambda h, n: h[n].__setitem__("data_offsets", [0])), "data_offsets"),
    "listed twice": (_listed_twice, "listed twice"),
}


@pytest.mark.parametrize("edit", sorted(OFFSET_EDITS))
def test_header_offsets_are_named_with_their_tensor(edit, tiny_ckpt, tmp_path, capsys, gpu_host):
    fn, words = OFFSET_EDITS[edit]
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    _rewrite_header(d / "model-00002-of-00002.safetensors", fn)
    line = _one_line(_run(capsys, "compare", d), 2, "model-00002-of-00002.safetensors", words)
    assert "model." in line or "lm_head" in line  # the tensor is named


@pytest.mark.parametrize("kind, words", [("fifo", "a FIFO"), ("dir", "a directory"), ("devnull", "a device node")])
def test_a_shard_that_is_no_file_is_not_called_missing(kind, words, tiny_ckpt, tmp_path, capsys, gpu_host):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    shard = d / "model-00002-of-00002.safetensors"
    shard.unlink()
    if kind == "fifo":
        os.mkfifo(shard)
    elif kind == "dir":
        shard.mkdir()
    else:
        os.symlink("/dev/null", shard)
    line = _one_line(_run(capsys, "compare", d), 2, "model-00002-of-00002.safetensors", words)
    assert "does not exist" not in line


def test_control_characters_are_escaped(tiny_ckpt, tmp_path, capsys, gpu_host):
    evil = "\x1b[2J\x1b]0;owned\x07"
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    _rewrite_header(d / "model-00002-of-00002.safetensors",
                    _entry_edit(lambda h, n: h.__setitem__(f"model.mtp_layers.0.{evil}.weight", h.pop(n))))
    wm = json.loads((d / "model.safetensors.index.json").read_text())
    raw = (d / "model-00002-of-00002.safetensors").read_bytes()
    hdr = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    for k in hdr:
        if evil in k:
            wm["weight_map"][k] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(wm))
    (tmp_path / f"file{evil}").write_text("a file, where a folder is needed")
    for argv in (["compare", d], ["compare", tmp_path / f"nope{evil}"], ["synth", tmp_path / f"file{evil}" / "a"]):
        code, lines, text = _run(capsys, *argv)
        assert code == 2 and "\x1b" not in text and "\x07" not in text, repr(text)
        assert len(lines) == 1 and "\\x1b" in lines[0], repr(text)


def test_thousands_of_unknown_names_are_cut(capsys, gpu_host):
    """(argparse itself takes seconds over 10,000 repeated flags: 1,500 show the same cut)"""
    names = [f"no-such-case-{i}" for i in range(1500)]
    argv = ["bisect-check"] + [a for n in names for a in ("--case", n)]
    line = _one_line(_run(capsys, *argv), 2, "no-such-case-0", "(+1495 more)")
    assert len(line) < 2000


def test_a_forged_marker_removes_nothing_outside_its_directory(tmp_path):
    from harness.atomic import atomic_write_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("not the harness's")
    out = tmp_path / "ck"
    atomic_write_dir(out, lambda d: (d / "config.json").write_text("{}"))
    doc = json.loads((out / MARKER).read_text())
    doc["files"] += ["../victim.txt", "/etc/hostname"]
    doc["dirs"] += [".."]
    (out / MARKER).write_text(json.dumps(doc))
    atomic_write_dir(out, lambda d: (d / "config.json").write_text('{"new": 1}'), replace=True)
    assert victim.read_text() == "not the harness's" and (out / "config.json").read_text() == '{"new": 1}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "victim.txt"]


def test_environment_values_past_the_int_string_limit(capsys, monkeypatch):
    monkeypatch.setenv("HYV4_PYTEST_WORKERS", "9" * 5000)
    _one_line(_run(capsys, "report", "--help"), 2, "$HYV4_PYTEST_WORKERS")


def test_names_from_a_report_or_a_path_are_escaped_on_success_too(tmp_path, capsys):
    p = _good_report(tmp_path)
    doc = json.loads(p.read_text())
    doc["cases"]["c\x1b[31m"] = doc["cases"].pop("c")
    p.write_text(json.dumps(doc))
    code, lines, text = _run(capsys, "report", p)
    assert code == 0 and "\x1b" not in text and "\\x1b[31m" in text, repr(text)
    code, lines, text = _run(capsys, "synth", tmp_path / "ck\x1b[2J")
    assert code == 0 and "\x1b" not in text and "\\x1b[2J" in text, repr(text)


def test_a_file_where_the_lock_goes_is_never_truncated_or_removed(tmp_path):
    from harness.atomic import InTheWay, atomic_write_dir

    lock = tmp_path / ".ck.lock"
    lock.write_text("my notes")
    with pytest.raises(InTheWay, match="in the way of the harness's lock"):
        atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text("{}"))
    assert lock.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == [".ck.lock"]
    lock.write_text("4194999")  # a killed writer's lock (its pid): taken over, then removed
    atomic_write_dir(tmp_path / "ck", lambda d: (d / "config.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_bytes_after_the_last_tensor_are_named(tiny_ckpt, tmp_path, capsys, gpu_host):
    d = shutil.copytree(tiny_ckpt, tmp_path / "ck")
    with open(d / "model-00001-of-00002.safetensors", "ab") as f:
        f.write(b"\0" * 6)
    _one_line(_run(capsys, "compare", d), 2, "model-00001-of-00002.safetensors", "6 unlisted bytes")


def test_usage_errors_are_escaped_and_cut(capsys):
    line = _one_line(_run(capsys, "reference", "preset:tiny", "--out", "t", "--seed", "9" * 5000), 2, "--seed")
    assert len(line) <= 2000 and "more characters" in line
    code, lines, text = _run(capsys, "reference", "preset:tiny", "--out", "t", "--device", "cu\x1b[2Jda")
    assert code == 2 and "\x1b" not in text and "\\x1b[2J" in text and len(lines) == 1, repr(text)
