"""Engine subprocesses: the engine command (``python -m harness engine``, ``harness.commands.engine``)
run as one process per case, concurrently, beside the process that started them, and how they
share the host with it.

    ENGINE_COMMAND      the command line of one engine process (every spawner uses it)
    start_engine_cases  one process per case, started at once (fixed KV size and a share of the
                        CPU cores when several processes use the GPU and the CPU)
    collect_engine_cases / stop_engine_cases / run_engine_cases
    ThreadShare         the starting process's own torch threads while its engines compute

Torch-free at import (``ThreadShare`` imports torch only where a count is changed): the command
layer imports this while it still checks arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from harness.exitcodes import EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, worst
from harness.process_clock import process_age_s
from harness.production.can_run import THREAD_VARS, cpu_share
from harness.production.engine.engine_env import engine_env

# One engine process: ``python -m harness engine`` (harness.entry.run ends it with
# ``harness.process_exit.exit_now`` once its report is written, skipping the in-process engine's
# teardown); its arguments follow (``--case ID --out DIR`` ...)
ENGINE_COMMAND = (sys.executable, "-m", "harness", "engine")


def run_engine_cases(case_ids) -> tuple[dict, int]:
    """Run engine cases (``python -m harness engine``, one subprocess each, so
    every engine gets a fresh process, all at once) -> ({case: summary}, worst exit code).
    A planted speculator bug named by ``HYV4_SPECULATOR_MUTANT`` reaches the subprocesses."""
    return collect_engine_cases(start_engine_cases(case_ids))


@dataclasses.dataclass
class EngineRun:
    case_id: str
    proc: object  # subprocess.Popen
    tmp: object  # tempfile.TemporaryDirectory: the report and the process's output
    started_s: float | None = None  # when, in seconds of this process's life (process_age_s)


def start_engine_cases(case_ids, *, gpu_shared: bool = False, fixed_kv: bool = False) -> list[EngineRun]:
    """Start one engine subprocess per case, concurrently, and return at once. Several engines,
    or an engine next to this process's own side-by-side runs (``gpu_shared``), share the GPU:
    they get a fixed KV size (``HYV4_ENGINE_KV_CACHE_GIB``, 4 GiB unless set), which skips vLLM's
    memory profiling (it fails when another process allocates or frees meanwhile) and asks
    its start-up check for 0.1 of the GPU (harness.production.engine.session.engine_kwargs).
    They share the host's CPU too: each gets its share of the cores as torch threads
    (``can_run.cpu_share``; this process takes its own with ``ThreadShare``). vLLM keeps a count
    set this way for serving, as it keeps any ``OMP_NUM_THREADS`` set outside it (unset, it drops
    its own process to 1 thread after loading); the GPU tier's engines run the same way, under
    their xdist worker's share."""
    # the processes on this host's CPU at once: the engines, and this one when it runs cases too
    # fixed_kv: this process touches the GPU meanwhile without computing beside them (start_early)
    env = engine_env(gpu_shared or fixed_kv or len(case_ids) > 1,
                     computing=len(case_ids) + (1 if gpu_shared else 0))
    env.pop("HYV4_HISTORY", None)  # this command records its engines in its own run (harness.history)
    runs = []
    try:
        for cid in case_ids:
            tmp = tempfile.TemporaryDirectory(prefix="hyv4-engine-")
            with open(os.path.join(tmp.name, "output.txt"), "w") as log:
                proc = subprocess.Popen([*ENGINE_COMMAND, "--case", cid, "--out", tmp.name],
                                        stdout=log, stderr=subprocess.STDOUT, env=env)
            runs.append(EngineRun(cid, proc, tmp, process_age_s()))
    except BaseException:
        stop_engine_cases(runs)
        raise
    return runs


def stop_engine_cases(runs: list[EngineRun]) -> None:
    """Kill started engines (this process is failing) and remove their files."""
    for r in runs:
        if r.proc.poll() is None:
            r.proc.kill()
        r.proc.wait()
        r.tmp.cleanup()


def collect_engine_cases(runs: list[EngineRun]) -> tuple[dict, int]:
    """Wait for started engines, print one line each (in case order) -> ({case: summary}, worst exit code)."""
    out, verdict = {}, EXIT_OK
    try:
        for r in runs:
            returncode = r.proc.wait()
            path = os.path.join(r.tmp.name, f"engine_mtp_{r.case_id}.json")
            rep = {}
            if os.path.isfile(path):
                with open(path) as f:
                    rep = json.load(f)
            code = returncode if returncode in (EXIT_OK, EXIT_MISMATCH) else EXIT_CANNOT_JUDGE
            problems = rep.get("problems") or []
            out[r.case_id] = {"exit": returncode, "problems": problems[:20], "acceptance": rep.get("acceptance"),
                              "counts": rep.get("counts"), "timing_s": rep.get("timing_s"),
                              "mutant": rep.get("mutant"), "drafter_mode": rep.get("drafter_mode"),
                              "compilation": rep.get("compilation"), "graph_replays": rep.get("graph_replays"),
                              "graph_facts": rep.get("graph_facts"), "graph_regimes": rep.get("graph_regimes"),
                              "components": rep.get("components")}
            label = r.case_id + (" [CUDA graphs]" if rep.get("drafter_mode") == "CUDA graphs" else "")
            if code == EXIT_OK:
                print(f"ok   engine {label}" + (f" (acceptance {_rates(rep)})" if rep.get("acceptance") else ""))
            elif code == EXIT_MISMATCH:
                print(f"FAIL engine {label}: {problems[0] if problems else 'exit 1, no report'}")
            else:
                with open(os.path.join(r.tmp.name, "output.txt"), errors="replace") as f:
                    tail = f.read().strip().splitlines()[-1:] or ["no output"]
                print(f"cannot judge: engine {r.case_id} exited {returncode}: {tail[0][:300]}")
            verdict = worst([verdict, code])
    finally:
        stop_engine_cases(runs)
    return out, verdict


def _rates(rep: dict) -> str:
    return ", ".join(f"{k}: {v['accepted']}/{v['drafted']}" for k, v in (rep.get("acceptance") or {}).items())


class ThreadShare:
    """This process's torch threads while ``runs`` (engine subprocesses started beside it) compute:
    its share of the cores (``can_run.cpu_share``, as theirs; never more than it had), back to
    what it had once they have all exited (``update``, between cases) or the work ends
    (``restore``). A thread count the user set (``OMP_NUM_THREADS``) is left alone. Thread counts
    move float64 CPU sums in their last bits only; every tolerance is orders of magnitude above that."""

    def __init__(self, runs: list):
        self.runs, self.before, self.facts = runs, None, {}
        if runs and not os.environ.get(THREAD_VARS[0], "").strip():
            import torch  # a GPU-side process: imported by now; lazy to keep this module torch-free
            self.before = torch.get_num_threads()
            torch.set_num_threads(min(self.before, cpu_share(len(runs) + 1)))
            self.facts = {"own": self.before, "beside_engines": torch.get_num_threads()}

    def update(self) -> None:
        if self.before is not None and all(r.proc.poll() is not None for r in self.runs):
            self.restore()

    def restore(self) -> None:
        if self.before is not None:
            import torch
            torch.set_num_threads(self.before)
            self.before = None
