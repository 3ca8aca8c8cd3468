"""``python -m harness autobisect``'s control flow over a synthetic git repository, with a stand-in
judge (``--judge``: a shell script answering 0 good, 1 bad, 125 skip from what the checked-out
commit holds): the culprit and its first divergent component, skipped commits, every step in the
history, bad input, and the source tree restored after SIGINT / SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]

# The stand-in judge: SKIP in the tree -> 125 (a commit that cannot be judged), BUG -> 1 with a
# harness report naming the component, else 0; each call logged. HANG in the tree: say so and wait.
JUDGE = r"""#!/bin/sh
echo "$AUTOBISECT_COMMIT" >> "$JUDGE_LOG"
if [ -f HANG ] && [ -n "$JUDGE_HANG" ]; then echo $$ > "$JUDGE_HANG"; sleep 60; fi
[ -f SKIP ] && exit 125
if [ -f BUG ]; then
  cat > "$AUTOBISECT_REPORT" <<EOF
{"meta": {}, "cases": {"side-by-side/tiny-seed0": {"passed": false, "first_divergent": "step0.attn.out",
 "components": [{"name": "step0.enorm", "passed": true, "max_abs": 1e-5, "max_rel": 0, "similarity_gap": 0,
                 "tolerance": {"atol": 1e-2, "rtol": 0}},
                {"name": "step0.attn.out", "passed": false, "max_abs": 0.5, "max_rel": 1, "mean_abs": 0.1,
                 "similarity_gap": 0, "tolerance": {"atol": 1e-2, "rtol": 1e-2}}]}}}
EOF
  exit 1
fi
exit "${JUDGE_DEFAULT:-0}"
"""


def _git(repo, *args) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def make_repo(tmp_path, n: int = 12, bug: int = 9, skip=(4, 5, 6, 7), hang=()) -> tuple[Path, list[str]]:
    """Commits 0..n-1 on branch ``work`` (tag ``good`` at 0): BUG from commit ``bug`` on, SKIP in
    the commits ``skip``, HANG in ``hang``; returns (repo, shas)."""
    repo = tmp_path / "src"
    repo.mkdir()
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "init", "-q", "-b", "work", str(repo)], check=True)
    shas = []
    for i in range(n):
        (repo / "f.txt").write_text(f"{i}\n")
        for name, on in (("BUG", i >= bug), ("SKIP", i in skip), ("HANG", i in hang)):
            if on:
                (repo / name).write_text("x\n")
            elif (repo / name).exists():
                (repo / name).unlink()
        subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, env=env)
        subprocess.run(["git", "-C", str(repo), "commit", "-q", "-m", f"commit {i}"], check=True, env=env)
        shas.append(_git(repo, "rev-parse", "HEAD"))
    _git(repo, "tag", "good", shas[0])
    return repo, shas


def judge(tmp_path, monkeypatch=None, **env) -> Path:
    path = tmp_path / "judge.sh"
    path.write_text(JUDGE)
    path.chmod(0o755)
    if monkeypatch is not None:
        monkeypatch.setenv("JUDGE_LOG", str(tmp_path / "judge.log"))
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    return path


def assert_restored(repo, head: str) -> None:
    assert _git(repo, "rev-parse", "HEAD") == head
    assert _git(repo, "symbolic-ref", "--short", "HEAD") == "work"
    assert not (repo / ".git" / "BISECT_START").exists()
    assert _git(repo, "status", "--porcelain") == ""


def test_the_culprit_is_named_with_its_first_divergent_component(tmp_path, monkeypatch, capsys):
    repo, shas = make_repo(tmp_path)
    j = judge(tmp_path, monkeypatch)
    hist, rep = tmp_path / "h.sqlite", tmp_path / "autobisect.json"
    code = cli_main(["autobisect", "--source", str(repo), "--good", "good", "--bad", "work", "--judge", str(j),
                     "--history", str(hist), "--report", str(rep)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"culprit: {shas[9]} commit 9" in out
    assert "first divergent: side-by-side/tiny-seed0: step0.attn.out: max|d| 5.000e-01 vs atol 1.0e-02 (x50)" in out
    doc = json.loads(rep.read_text())
    assert doc["culprit"] == shas[9]
    steps = doc["steps"]
    assert steps[0]["commit"] == shas[11] and steps[0]["exit"] == 1  # the bad end, judged first
    assert any(s["exit"] == 125 for s in steps), steps  # the midpoint is skipped: 125 was answered and honoured
    judged = (tmp_path / "judge.log").read_text().split()
    assert judged == [s["commit"] for s in steps]
    with sqlite3.connect(hist) as c:
        rows = c.execute("SELECT vllm_commit, exit_code, kind, label FROM runs ORDER BY started_at").fetchall()
    assert sorted((r[0], r[1]) for r in rows) == sorted((s["commit"], s["exit"]) for s in steps)
    assert {r[2] for r in rows} == {"autobisect-step"} and len({r[3] for r in rows}) == 1
    assert_restored(repo, shas[-1])


def test_each_step_keeps_vllms_cache_layer_apart(tmp_path, monkeypatch, capsys):
    """A step judges another vLLM tree than the installed one: its judge gets a vLLM cache layer
    under the run's work folder (one for all its steps), never the root the installed tree's
    processes share."""
    repo, shas = make_repo(tmp_path, n=4, bug=2, skip=())
    seen = tmp_path / "roots.log"
    j = tmp_path / "judge.sh"
    j.write_text(f'#!/bin/sh\necho "$VLLM_CACHE_ROOT" >> {seen}\n[ -f BUG ] && exit 1\nexit 0\n')
    j.chmod(0o755)
    shared = tmp_path / "jit" / "vllm"
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(shared))
    work = tmp_path / "work"
    code = cli_main(["autobisect", "--source", str(repo), "--good", shas[0], "--bad", "work", "--judge", str(j),
                     "--work", str(work)])
    assert code == 0, capsys.readouterr().out
    roots = seen.read_text().split()
    assert len(roots) >= 2 and set(roots) == {str(work.resolve() / "vllm-cache")}
    assert os.environ["VLLM_CACHE_ROOT"] == str(shared)  # this process's own is left as it was


def test_only_skipped_commits_left_names_the_candidates(tmp_path, monkeypatch, capsys):
    repo, shas = make_repo(tmp_path, n=5, bug=4, skip=(1, 2, 3))
    j = judge(tmp_path, monkeypatch)
    assert cli_main(["autobisect", "--source", str(repo), "--good", "good", "--bad", "work", "--judge", str(j)]) == 125
    out = capsys.readouterr().out
    assert "only skipped commits left" in out and shas[4][:12] in out and shas[1][:12] in out
    assert_restored(repo, shas[-1])


@pytest.mark.parametrize("case", ["dirty", "in-progress", "not-ancestor", "bad-end-good", "judge-says-2"])
def test_bad_input_is_exit_2_and_the_tree_stays(tmp_path, monkeypatch, capsys, case):
    repo, shas = make_repo(tmp_path, n=4, bug=2, skip=())
    j = judge(tmp_path, monkeypatch)
    good, bad = "good", "work"
    if case == "dirty":
        (repo / "f.txt").write_text("edited\n")
    elif case == "in-progress":
        _git(repo, "bisect", "start")
    elif case == "not-ancestor":
        good, bad = "work", "good"
    elif case == "bad-end-good":
        (tmp_path / "judge.sh").write_text("#!/bin/sh\nexit 0\n")
    else:
        monkeypatch.setenv("JUDGE_DEFAULT", "2")  # the first good-looking commit answers 2: abort
    code = cli_main(["autobisect", "--source", str(repo), "--good", good, "--bad", bad, "--judge", str(j)])
    captured = capsys.readouterr()
    assert code == 2, captured
    if case == "dirty":
        assert "tracked files have changes" in captured.err
        assert (repo / "f.txt").read_text() == "edited\n"
        return
    if case == "in-progress":
        assert "already in progress" in captured.err
        return
    assert_restored(repo, shas[-1])


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_stops_the_step_and_restores_the_tree(tmp_path, sig, code):
    repo, shas = make_repo(tmp_path, n=8, bug=6, skip=(), hang=(3, 4))
    j = judge(tmp_path)
    hang = tmp_path / "hang.pid"
    env = dict(os.environ, JUDGE_LOG=str(tmp_path / "judge.log"), JUDGE_HANG=str(hang),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("HYV4_HISTORY", None)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "autobisect", "--source", str(repo), "--good", "good",
                             "--bad", "work", "--judge", str(j)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # SIGINT as an interactive shell leaves it: a test run started as a background
                            # job inherits it ignored, and the harness keeps an inherited ignore (nohup)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not (hang.exists() and hang.read_text().strip()) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    judge_pid = int(hang.read_text())
    assert _git(repo, "rev-parse", "HEAD") != shas[-1]  # mid-bisect: another commit checked out
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code, (out, err)
    assert "interrupted" in err
    assert_restored(repo, shas[-1])
    with pytest.raises(ProcessLookupError):  # the hanging judge was stopped with its step
        for _ in range(50):
            os.kill(judge_pid, 0)
            time.sleep(0.1)
