"""The README as a guide: a fresh machine needs exactly two commands (the main job, the tests),
``.ci/run`` runs the README's test command as it is written, and every file the README links
to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _setup_commands() -> list[str]:
    section = README.split("## Set up and run on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]


def test_a_fresh_machine_takes_two_commands_and_ci_runs_the_readme_s_tests():
    main_job, tests = _setup_commands()
    assert main_job == "./with-env python -m harness main"
    assert tests == "./with-env python -m pytest"
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    assert tests in ci, f".ci/run does not run the README's test command {tests!r}"


def test_every_linked_file_exists():
    links = re.findall(r"\]\(([^)#\s]+)\)", README)
    assert "docs/bisect.md" in links and "docs/gpu-hosts.md" in links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing
    for doc in ("docs/bisect.md", "docs/gpu-hosts.md", "benchmarks/NOTES.md"):
        text = (ROOT / doc).read_text()
        missing = [link for link in re.findall(r"\]\(([^)#\s]+)\)", text)
                   if "://" not in link and not (ROOT / doc).parent.joinpath(link).exists()]
        assert not missing, (doc, missing)
