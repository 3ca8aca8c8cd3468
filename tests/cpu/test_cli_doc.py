"""``docs/cli.md`` is generated (``tools/gen-cli-doc.py``) and current; every flag of ``python -m
harness`` says what it does; every ``HYV4_*`` variable the sources name has its one entry in
``harness.env_vars.ENV_VARS`` and every entry there is read somewhere. No torch: the parser and
the table import none."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"HYV4_[A-Z0-9_]*[A-Z0-9]")
# not sources: run logs, recorded data, the generated doc (which restates the table), the table itself
SKIP_DIRS = {".git", "reports", "goldens", "__pycache__", ".pytest_cache", ".hypothesis", ".gpu-bundle"}
SKIP_FILES = {ROOT / "docs" / "cli.md", ROOT / "harness" / "env_vars.py"}
TEXT_SUFFIXES = {"", ".py", ".sh", ".md", ".txt", ".ini", ".toml", ".cfg", ".json", ".yml", ".yaml"}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_cli_doc", ROOT / "tools" / "gen-cli-doc.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sources():
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.startswith("venv")]
        for f in filenames:
            path = Path(dirpath) / f
            if path.suffix in TEXT_SUFFIXES and path not in SKIP_FILES and path.stat().st_size < 1_000_000:
                yield path


def names_in_sources() -> dict[str, Path]:
    """{HYV4_ name: the first file naming it}."""
    found: dict[str, Path] = {}
    for path in _sources():
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        for name in NAME.findall(text):
            found.setdefault(name, path.relative_to(ROOT))
    return found


def undocumented(found, table) -> list[str]:
    return sorted(f"{name} ({where})" for name, where in found.items() if name not in table)


def test_checked_in_doc_is_the_generated_one():
    doc = ROOT / "docs" / "cli.md"
    assert doc.is_file(), "docs/cli.md is missing: run tools/gen-cli-doc.py"
    assert doc.read_text() == _generator().render(), "docs/cli.md is out of date: run tools/gen-cli-doc.py"


def test_every_flag_says_what_it_does():
    from harness.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    missing = [name for name in sub.choices if not helps.get(name)]
    for prog, p in [("python -m harness", parser), *((f"python -m harness {n}", p) for n, p in sub.choices.items())]:
        for action in p._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            if not (action.help or "").strip():
                missing.append(f"{prog} {'/'.join(action.option_strings) or action.metavar or action.dest}")
    assert not missing, f"give these a help= (it is their documentation in docs/cli.md): {missing}"


def test_every_hyv4_variable_is_documented_once():
    from harness.env_vars import ENV_VARS
    from harness.input_checks import ENVIRONMENT

    found = names_in_sources()
    assert "HYV4_JIT_CACHE" in found and "HYV4_REQUIREMENTS" in found  # the scan reads code and shell scripts
    assert not undocumented(found, ENV_VARS), (
        f"HYV4_ variables without an entry in harness/env_vars.py: {undocumented(found, ENV_VARS)}")
    stale = sorted(set(ENV_VARS) - set(found))
    assert not stale, f"harness/env_vars.py documents variables nothing reads: {stale}"
    assert set(ENVIRONMENT) <= set(ENV_VARS), set(ENVIRONMENT) - set(ENV_VARS)
    for name, (read_by, meaning) in ENV_VARS.items():
        assert NAME.fullmatch(name) and read_by.strip() and meaning.strip(), name


def test_a_new_variable_is_caught(tmp_path):
    """The check above fails on a name the table lacks (the scan's regex and the comparison)."""
    from harness.env_vars import ENV_VARS

    new = "HYV4" + "_NEW_KNOB"  # spelled in two halves so that this file itself does not name it
    found = {n: Path("x.py") for n in NAME.findall(f'os.environ.get("{new}") or "$HYV4_JIT_CACHE" HYV4_*')}
    assert undocumented(found, ENV_VARS) == [f"{new} (x.py)"]


def test_the_generator_imports_no_torch():
    code = ("import runpy, sys; sys.argv = ['gen-cli-doc.py', '--check']; "
            "m = runpy.run_path('tools/gen-cli-doc.py'); m['render'](); "
            "bad = sorted(k for k in ('torch', 'vllm', 'transformers') if k in sys.modules); "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
