"""One command line: every command is a subcommand of ``python -m harness`` (``harness.cli``) and of
the console script ``hyv4-harness`` (``[project.scripts]``, the same function); each answers
``--help`` with exit 0; no module under ``harness/`` keeps a ``__main__`` block or a ``__main__.py``
of its own (``harness/__main__.py`` is the one entry point)."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness import cli
from harness.commands import passthrough

ROOT = Path(__file__).resolve().parents[2]


def _subcommands() -> list[str]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def test_the_commands_with_their_own_parser_are_listed():
    names = _subcommands()
    for name in ("engine", "goldens", "side-by-side", "speculator-mutants", "fp8-emulation", "kv-fp8-emulation",
                 "ci", "autobisect-step"):
        assert name in names and name in cli.TOOLS, name
    assert set(passthrough.CI_VERBS) == {"timeline", "schedule", "prefetch"}


@pytest.mark.parametrize("argv", [[name] for name in _subcommands()] + [["ci", verb] for verb in passthrough.CI_VERBS])
def test_every_subcommand_answers_help_with_exit_0(argv, capsys, monkeypatch):
    """In process (one torch import for all): what ``python -m harness ARGV --help`` runs."""
    from harness.ci_speed.jit_cache import JIT_CACHE_ENV

    monkeypatch.delenv(JIT_CACHE_ENV, raising=False)  # the JIT cache root is not this test's
    try:
        code = cli.main([*argv, "--help"])
    except SystemExit as exc:  # argparse's --help
        code = exc.code
    out = capsys.readouterr().out
    assert code in (0, None), (argv, out)
    assert "usage:" in out and "python -m harness " + argv[0] in out, out[:300]


def test_python_m_harness_help_lists_every_command():
    r = subprocess.run([sys.executable, "-m", "harness", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for name in _subcommands():
        assert name in r.stdout, name


def test_an_unknown_ci_command_is_one_line_and_2(capsys):
    assert cli.main(["ci", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: python -m harness ci: unknown command 'nope'"), err


def _main_blocks(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            consts = {n.value for n in ast.walk(node.test) if isinstance(n, ast.Constant)}
            if "__name__" in names and "__main__" in consts:
                return True
    return False


def test_no_module_but_harness_main_is_an_entry_point():
    main_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "harness").rglob("__main__.py"))
    assert main_files == ["harness/__main__.py"], main_files
    blocks = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "harness").rglob("*.py") if _main_blocks(p))
    assert not blocks, f"route these through harness/cli.py instead of `if __name__ == '__main__'`: {blocks}"
    assert _main_blocks(ROOT / "tools" / "gen-cli-doc.py")  # the scan finds a block where there is one


def test_the_console_script_is_what_python_m_harness_runs():
    """Both end the same way: ``harness.entry.run`` (cli.main, then exit_now: no teardown that could
    replace the exit code or hold the GPU)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"hyv4-harness": "harness.entry:run"}
    module, _, func = scripts["hyv4-harness"].partition(":")
    from harness import entry

    assert module == entry.__name__ and callable(getattr(entry, func))
    tree = ast.parse((ROOT / "harness" / "__main__.py").read_text())
    imported = [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert ("entry", "run") in imported
    assert any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "run" for n in ast.walk(tree))
    src = (ROOT / "harness" / "entry.py").read_text()
    assert "exit_now(code)" in src and "from .cli import main" in src


def test_the_console_script_ends_with_the_commands_exit_code(tmp_path):
    """What the installed script does, run the way a console-script wrapper runs it."""
    code = ("import sys; sys.argv = ['hyv4-harness', 'report', '/nonexistent.json']; "
            "from harness.entry import run; run()")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stdout, r.stderr)


@pytest.mark.parametrize("argv", [["side-by-side", "--case", "nope"],
                                  ["side-by-side", "--rejudge", "/nowhere", "--case", "nope"],
                                  ["fp8-emulation", "--case", "nope"], ["kv-fp8-emulation", "--case", "nope"],
                                  ["fp8-emulation", "--extra-seeds", "-1"], ["engine", "--case", "nope"]])
def test_an_unknown_case_is_one_line_and_2_before_anything_runs(argv, capsys, monkeypatch):
    """Bad input is checked first, on any machine: not 'cannot judge: no CUDA device' (125) and not a
    KeyError traceback (1), as side-by-side and the emulations gave before."""
    from harness.ci_speed.jit_cache import JIT_CACHE_ENV

    monkeypatch.delenv(JIT_CACHE_ENV, raising=False)
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (argv, err)
    assert len(err) == 1 and err[0].startswith(f"error: python -m harness {argv[0]}: "), err


@pytest.mark.parametrize("summary, trace_keys, culprit", [
    ('{"cases": [{"nocase": 1}]}', None, "cases[0] holds no case with an id"),
    ('{"cases": 5}', None, "'cases' is not a list"),
    ('[1]', None, "not a saved side-by-side summary"),
    ('{"cases": [{"case": {"id": "tiny-k1", "naming": "bogus"}}]}', ["tiny-k1/step0.embed"],
     "cases[0] (tiny-k1): module case 'tiny-k1': naming='bogus' is not one of"),
    ('{"cases": [{"case": {"id": "tiny-k1", "nofield": 3}}]}', ["tiny-k1/step0.embed"],
     "unexpected keyword argument 'nofield'"),
    ('{"cases": []}', ["nokey"], "tensor 'nokey' is not named CASE/COMPONENT"),
    ('{"cases": []}', "garbage", "not a safetensors file"),
])
def test_a_malformed_saved_run_given_to_rejudge_is_one_line_and_2(summary, trace_keys, culprit, tmp_path, capsys):
    """side-by-side --rejudge DIR reads a saved run: a summary, a trace file or a case record this
    harness cannot read is bad input named in one line (it raised KeyError / TypeError before)."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "side_by_side.json").write_text(summary)
    if trace_keys == "garbage":
        (tmp_path / "prod-traces-0.safetensors").write_text("garbage")
    elif trace_keys:
        save_file({k: torch.zeros(2) for k in trace_keys}, str(tmp_path / "prod-traces-0.safetensors"))
    code = cli.main(["side-by-side", "--rejudge", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and culprit in err[0], (code, err)


@pytest.mark.parametrize("argv, culprit", [
    (["goldens", "list", "--root", "{tmp}/nowhere"], "--root {tmp}/nowhere: no such directory"),
    (["goldens", "check", "--root", "{tmp}/a-file"], "--root {tmp}/a-file: is a regular file"),
    (["goldens", "record", "--root", "{tmp}/a-file/x"], "--root {tmp}/a-file/x: a folder on the path is a file"),
    (["side-by-side", "--out", "{tmp}/a-file/x", "--case", "tiny-k1"], "--out {tmp}/a-file/x: a folder on the path"),
    (["side-by-side", "--rejudge", "{tmp}/nowhere"], "--rejudge {tmp}/nowhere: no such directory"),
    (["speculator-mutants", "--report", "{tmp}/a-file/r.json"], "--report {tmp}/a-file/r.json: a folder on the path"),
    (["fp8-emulation", "--json", "{tmp}", "--case", "tiny-k2-fp8-split-long"], "--json {tmp}: is a directory"),
])
def test_a_bad_path_is_one_line_and_2_before_the_gpu_question(argv, culprit, tmp_path, capsys, monkeypatch):
    """Paths are bad input, checked first on any machine: not 'cannot judge: no CUDA device' (125),
    and not a traceback after the work (fp8-emulation --json wrote with open() once it had run)."""
    from harness.ci_speed.jit_cache import JIT_CACHE_ENV

    monkeypatch.delenv(JIT_CACHE_ENV, raising=False)
    (tmp_path / "a-file").write_text("x")
    try:
        code = cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and culprit.replace("{tmp}", str(tmp_path)) in err[0], (code, err)
