"""``python -m harness warmup``: compile the GPU stack's JIT kernels once per host, in one process.

    python -m harness warmup [--cache DIR] [--case ID ...] [--engine ID ... | --no-engine | --engine-only]
                             [--no-mutants | --mutants-only]
                             [--if-cold] [--lanes N] [--report FILE.json]
                             [--restore PACK_DIR [--restore-only]] [--pack PACK_DIR [--part-bytes N]]

A fresh GPU host spends most of the GPU tier compiling: FlashInfer's FP8 block GEMM
(> 150 s), DeepGEMM's indexer and FP8 kernels per shape, Triton's fused MoE per
shape, vLLM's engine start. Several processes compiling the same kernel at once can
stall for minutes, so the parallel GPU tier (``.ci/gpu-tier``) runs this first, in
one process, and fans out after. It runs the production side only (no reference,
no verdict) of every module-level side-by-side case, which covers every shape the
GPU tier's module-level cases use (a reload case runs whole: its production side is vLLM's
in-place weight reload, which no plain load runs), and builds the engines (``_default_engines``: the eager
engine case, every engine case of ``bisect-check`` -- its two-MTP-layer case runs vLLM's
multi-module speculator and its Triton kernels -- and every CUDA-graph engine case, whose capture
and graph-mode kernels an eager engine never builds) and generates with each. Each step ends by
building the C launchers of the Triton kernels it compiled without launching them (vLLM's start-up
JIT warmup compiles its Triton kernels that way; ``triton_launchers``), which a later run on
other paths (a planted bug's, say) would otherwise build.

The caches land where each library keeps them, or under one root with ``--cache DIR``
/ ``$HYV4_JIT_CACHE`` (``harness.ci_speed.jit_cache.JIT_CACHE_LAYOUT``: vLLM, Triton, FlashInfer,
DeepGEMM, inductor, the driver's PTX cache). ``--pack PACK_DIR`` writes that root, after
warming, for the next host as a folder of parts keyed by every version that decides the
compiled bytes (``harness.ci_speed.jit_pack``: part.NN, SHA256SUMS, MANIFEST); ``--restore
PACK_DIR`` puts such a pack into the root before anything compiles (``--restore-only``: and
stops there). A pack of another key (release, architecture, ...) is refused in one line and not
used: the steps compile as on a bare host; a malformed, truncated or tampered one is bad input
(exit 2), nothing unpacked.
Each warmed step is stamped in the root (``hyv4-warm.json``: the versions of torch,
CUDA, vLLM and the GPU, and a fingerprint of the case's definition); ``--if-cold``
runs only the steps the stamp does not hold for these versions, so a host with a
kept cache pays seconds, not the ~100 s of re-running every case; where the stamp holds
every step, the versions are read without importing vLLM and the host checks are left to
the runs that follow (each checks the host itself).
``--lanes N`` (.ci/gpu-tier: 4) runs the first bf16 case alone (it compiles the kernels
every case shares), then the rest in up to N processes at once, one per kernel family:
the FP8 checkpoints (FlashInfer's FP8 block GEMM, the longest compile), each engine,
real dims, the other bf16 cases; the planted bugs' production runs (``harness.mutants``: a bug
can change what vLLM compiles, e.g. a routing constant baked into a torch.compile'd graph) in a
lane of their own. With lanes, each kernel a library can build alone (``PREFETCH``) starts
beside the first case, and the lane that needs it waits on FlashInfer's build lock (the
figures: benchmarks/NOTES.md). The cache root holds Python's bytecode too (``ROOT/pycache``; not packed).
FlashInfer's precompiled kernels (``vllm download-kernels``: ``flashinfer-cubin`` /
``flashinfer-jit-cache`` 0.7.2.post1, the version vLLM 0.33 pins) are published only
on flashinfer.ai, not on PyPI (which stops at flashinfer-cubin 0.6.13, refused by
FlashInfer's version check), so an air-gapped host builds them here instead.

Exit codes (``harness.exitcodes``): 0 warmed (or restored), 2 bad flags or a bad pack, 125
cannot warm (no GPU, vLLM missing, a case that crashed: the line names it). Warmup judges nothing: a
case's numbers are not looked at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from .. import case_registry  # torch-free: the cases' ids and specs, no inputs made
from ..exitcodes import EXIT_CANNOT_JUDGE, EXIT_OK, CannotJudge, CLIError
from ..production import can_run  # cannot_run_production_reason looked up at call time (tests patch it)
from . import jit_cache, jit_pack
from .kernel_prefetch import PREFETCH, plan_prefetch
from .triton_launchers import build_pending_launchers
from .warm_stamp import cold_steps, fingerprint, mutants_fingerprint, mutants_wanted, read_stamp, write_stamp
from .jit_cache import JIT_CACHE_ENV, apply_jit_cache

MAX_LANES = 64  # parallel compile processes
MUTANTS_STEP = "module-mutants"  # every planted bug's production run (harness.mutants.driver.warm_catalogue)
DEFAULT_ENGINE_CASE = "engine-accept-k3-share"  # index sharing + acceptance: the most engine code paths


def _default_engines() -> tuple[str, ...]:
    """The eager engine case, every engine case a ``bisect-check`` runs (``--graphs`` included), then
    every other CUDA-graph engine case (each its own configuration of capture, torch.compile and
    draft-decode kernels: K, index sharing, padded batch sizes, the drafter's own options). A bisect
    case with two MTP layers runs vLLM's multi-module speculator, whose input kernels (Triton) no
    one-layer case builds. A graph-mode reload case is warmed too, through its reload path: its
    configuration is its own (torch.compile builds the model it holds, which no other case may)."""
    engine_cases = case_registry.specs(kind="engine")

    bisect = [*case_registry.ids(role="bisect", kind="engine"), *case_registry.ids(role="graph-bisect", kind="engine")]
    graphs = [cid for cid, spec in engine_cases.items() if spec.graphs]
    return tuple(dict.fromkeys((DEFAULT_ENGINE_CASE, *bisect, *graphs)))


def _warm_engine(case) -> None:
    """One engine case the way the tier runs it (quiet): a reload case through the engine's reload
    path (two generations around vLLM's in-place weight update), any other through ``run_case``. A
    reload vLLM refuses (``problems``) is the judged run's finding, not a host that cannot warm."""
    quiet = lambda *a, **k: None  # noqa: E731 - the verdict is not looked at
    if case.reload_seed is not None:
        from ..production.engine.reload import run_reload_engine_case
        try:
            run_reload_engine_case(case, log=quiet)
        except Exception as exc:
            if not getattr(exc, "problems", None):
                raise
    else:
        from ..production.engine.generation_judge import run_case
        run_case(case, log=quiet)


def engines_of(args) -> list[str]:
    """The engine cases ``args`` asks to warm, in order, without repeats."""
    if getattr(args, "no_engine", False) or getattr(args, "mutants_only", False):
        return []
    chosen = args.engine if args.engine is not None else _default_engines()
    chosen = [chosen] if isinstance(chosen, str) else list(chosen)
    return list(dict.fromkeys(chosen))


def add_arguments(p) -> None:
    p.add_argument("--cache", metavar="DIR", help=f"one cache root for every JIT layer (default ${JIT_CACHE_ENV}, "
                   "else each library's own default)")
    p.add_argument("--case", action="append", metavar="ID", help="module-level case to run (default: all)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--engine", action="append", metavar="ID", help="engine case to build and run (repeatable; "
                   f"default: {DEFAULT_ENGINE_CASE}, every engine case of bisect-check and every CUDA-graph "
                   "engine case)")
    g.add_argument("--no-engine", action="store_true", help="skip the engine")
    p.add_argument("--engine-only", action="store_true", help="only the engine (no module-level case)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--no-mutants", action="store_true", help="skip the planted bugs' production runs (warmed "
                   "by default with every module case: a bug can change what vLLM compiles)")
    m.add_argument("--mutants-only", action="store_true", help="only the planted bugs' production runs")
    p.add_argument("--lanes", type=int, default=1, metavar="N", help="after the first case, warm up to N kernel "
                   "families in parallel processes (default 1: one process, in order)")
    p.add_argument("--if-cold", action="store_true", help="skip the steps the cache root's stamp holds for "
                   "these versions (needs --cache or $HYV4_JIT_CACHE)")
    p.add_argument("--report", metavar="FILE.json", help="write the per-step times here")
    p.add_argument("--pack", metavar="PACK_DIR", help="after warming, pack the cache root into this folder for "
                   "the next host: part.NN, SHA256SUMS, MANIFEST with the key (versions, GPU architecture); "
                   f"needs --cache or ${JIT_CACHE_ENV}")
    p.add_argument("--part-bytes", type=int, default=jit_pack.PART_BYTES, metavar="N",
                   help=f"largest part of --pack (default {jit_pack.PART_BYTES}, as the offline bundle's)")
    p.add_argument("--restore", metavar="PACK_DIR", help="before anything compiles, restore a --pack folder into "
                   "the cache root; one of another key (release, architecture) is refused in one line and not "
                   f"used (needs --cache or ${JIT_CACHE_ENV})")
    p.add_argument("--restore-only", action="store_true", help="restore --restore PACK_DIR and stop (no step "
                   "is warmed)")


def check_arguments(args) -> None:
    """Bad flags exit 2 before anything is imported or compiled."""
    gpu_cases = case_registry.specs(kind="module", without="probe")
    engine_cases = case_registry.specs(kind="engine")

    for cid in args.case or ():
        if cid not in gpu_cases:
            from ..exitcodes import listed
            raise CLIError(f"--case {listed([cid])}: unknown; known: {listed(gpu_cases, 40)}")
    if getattr(args, "engine_only", False) and (args.case or args.no_engine):
        raise CLIError(f"--engine-only and {'--case' if args.case else '--no-engine'}: choose one")
    if getattr(args, "mutants_only", False) and (args.case or getattr(args, "engine_only", False) or args.engine):
        raise CLIError("--mutants-only and " + ("--case" if args.case else "--engine-only" if args.engine_only
                                                else "--engine") + ": choose one")
    if getattr(args, "lanes", 1) < 1:
        raise CLIError(f"--lanes {args.lanes}: give 1 or more")
    for eid in engines_of(args):
        if eid not in engine_cases:
            from ..exitcodes import listed
            raise CLIError(f"--engine {listed([eid])}: unknown; known: {listed(engine_cases, 40)}")
    restore = getattr(args, "restore", None)
    if getattr(args, "restore_only", False) and (not restore or args.pack):
        raise CLIError("--restore-only " + ("and --pack: choose one (--restore-only warms nothing to pack)"
                                            if restore else "needs --restore PACK_DIR"))
    for flag, wanted in (("--pack", args.pack), ("--if-cold", getattr(args, "if_cold", False)),
                         ("--restore", restore)):
        if wanted and not (args.cache or os.environ.get(JIT_CACHE_ENV)):
            raise CLIError(f"{flag} needs one cache root: give --cache DIR or set {JIT_CACHE_ENV}")
    from .. import input_checks as check

    check.integer("--lanes", args.lanes, 1, MAX_LANES)
    if args.cache is not None:
        check.output_dir("--cache", args.cache)
    root = args.cache or os.environ.get(JIT_CACHE_ENV)
    if args.pack is not None and root and (os.path.realpath(args.pack) + os.sep).startswith(
            os.path.realpath(root).rstrip(os.sep) + os.sep):
        raise CLIError(f"--pack {args.pack}: inside the cache root {root} it packs; write it elsewhere")
    if args.report is not None:
        check.output_file("--report", args.report)
        parent = os.path.dirname(os.path.abspath(args.report))
        if not os.path.isdir(parent):
            raise CLIError(f"--report {args.report}: not a writable file path (its folder {parent} is missing)")
    if args.pack is not None:
        check.replaceable_dir("--pack", args.pack)
        from ..atomic import check_replaceable

        # a folder the harness did not write is refused now, not after the warmup
        check_replaceable(args.pack, True, f"--pack {args.pack}")
        check.integer("--part-bytes", getattr(args, "part_bytes", jit_pack.PART_BYTES), 1 << 16, 1 << 32)
    if restore is not None:
        check.input_dir("--restore", restore)
        if root and os.path.realpath(restore) == os.path.realpath(root):
            raise CLIError(f"--restore {restore}: is the cache root itself; give the folder --pack wrote")
        jit_pack.read_manifest(restore)  # a folder that is not a pack: refused before anything runs


def cache_size(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def plan_lanes(cases: list[str], engines, lanes: int, mutants: bool = False) -> tuple[str | None, list[dict]]:
    """(lead, lanes) for ``--lanes``: the lead (the first bf16 case) runs alone and compiles
    the kernels every case shares; then each kernel family -- FP8 checkpoints, each engine
    (``engines``: an id, a list of ids or None), real dims, the other bf16 cases, in that order
    of their cold cost -- goes to lane i mod ``lanes``. A lane is {"cases": [...], "engines":
    [...]}; a family that is not wanted leaves no lane. ``mutants``: the planted bugs' runs, a lane of
    their own after the others ({"cases": [], "engines": [], "mutants": True})."""
    gpu_cases = case_registry.specs(kind="module", without="probe")

    engines = [] if engines is None else [engines] if isinstance(engines, str) else list(engines)
    bf16 = [c for c in cases if gpu_cases[c].quant == "bf16" and gpu_cases[c].preset != "real-dims"]
    lead = bf16[0] if bf16 and len(cases) + len(engines) > 1 else None
    families = [{"cases": [c for c in cases if gpu_cases[c].quant != "bf16"], "engines": []},
                *({"cases": [], "engines": [e]} for e in engines),
                {"cases": [c for c in cases if gpu_cases[c].preset == "real-dims" and gpu_cases[c].quant == "bf16"],
                 "engines": []},
                {"cases": [c for c in bf16 if c != lead], "engines": []}]
    families = [f for f in families if f["cases"] or f["engines"]]
    shared = max(1, lanes - 1) if mutants and families else lanes
    out = [{"cases": [], "engines": []} for _ in range(min(shared, len(families)))]
    for i, fam in enumerate(families):
        lane = out[i % len(out)]
        lane["cases"] += fam["cases"]
        lane["engines"] += fam["engines"]
    if mutants:
        out.append({"cases": [], "engines": [], "mutants": True})
    return lead, out


def _lane_command(cases: list[str], engines: list[str], report: str, mutants: bool = False) -> list[str]:
    cmd = [sys.executable, "-m", "harness", "warmup", "--report", report]
    if mutants:
        return cmd + ["--mutants-only"]
    for c in cases:
        cmd += ["--case", c]
    if not engines:
        return cmd + ["--no-engine"]
    cmd += [] if cases else ["--engine-only"]
    for e in engines:
        cmd += ["--engine", e]
    return cmd


def _lane_names(lane: dict) -> list[str]:
    return lane["cases"] + lane["engines"] + ([MUTANTS_STEP] if lane.get("mutants") else [])


def _last_line(log_path: str) -> str:
    """A child's last output line (what a lane's or a prefetch's failure is named with)."""
    with open(log_path, errors="replace") as f:
        return (f.read().strip().splitlines() or ["no output"])[-1][:300]


def _start_prefetch(names: list[str], tmp: str) -> list[tuple]:
    started = []
    for name in names:
        out = os.path.join(tmp, f"prefetch-{name}.log")
        with open(out, "w") as f:
            proc = subprocess.Popen([sys.executable, "-c", PREFETCH[name][1]], stdout=f, stderr=subprocess.STDOUT)
        started.append((name, proc, out, time.perf_counter()))
    return started


def _wait_ends(procs: list, ended: dict, watch: list = ()) -> None:
    """Wait until every process of ``procs`` has exited, noting each one's end time in ``ended``
    (process -> ``perf_counter``) as it comes, and those of ``watch`` (still running beside them:
    the prefetches during the waves) the same way."""
    while True:
        for proc in [*procs, *watch]:
            if proc not in ended and proc.poll() is not None:
                ended[proc] = time.perf_counter()
        if all(p in ended for p in procs):
            return
        time.sleep(0.1)


def _wait_prefetch(started: list[tuple], log=print, t_origin: float | None = None,
                   ended: dict | None = None) -> list[dict]:
    """Each prefetch's step, its seconds up to its own exit (``ended``: the end times noted while
    the lanes ran). A failed prefetch is not fatal: the lane that needs the kernel builds it
    itself (and fails, named, if it cannot); the step keeps the prefetch's last line.
    ``t_origin``: the warmup's start, for the step's ``span_s`` (start and end, seconds from it)."""
    ended = {} if ended is None else ended
    _wait_ends([proc for _, proc, _, _ in started], ended)
    steps = []
    for name, proc, out, t0 in started:
        rc, last = proc.returncode, _last_line(out)
        st = {"name": name, "seconds": round(ended[proc] - t0, 2), "lane": "prefetch", "last_line": last}
        if t_origin is not None:
            st["span_s"] = [round(t0 - t_origin, 2), round(ended[proc] - t_origin, 2)]
        if rc != 0:
            st["error"] = f"exit {rc}"
        steps.append(st)
        log(f"warmup prefetch {name}: {st['seconds']:.1f} s, exit {rc}: {last}", flush=True)
    return steps


def run_lanes(lead: str | None, lanes: list[dict], log=print, prefetch: list[str] = (), meanwhile=None,
              t_origin: float | None = None) -> list[dict]:
    """Run the ``prefetch`` kernels and the lead at once, then the lanes at once (the
    prefetches may still be building), each a process (the JIT cache root and every other
    variable inherited) -> their steps, each with its lane; a lane that fails is CannotJudge
    naming it and its last line. ``meanwhile``: called once the lead and the prefetches are
    started, before anything is waited for (the caller's own checks: what it raises stops every
    process started). ``t_origin``: the warmup's start, for each lane's and prefetch's ``span_s``."""
    t_origin = time.perf_counter() if t_origin is None else t_origin
    jobs = ([[{"cases": [lead], "engines": []}]] if lead else []) + [lanes]
    steps = []
    with tempfile.TemporaryDirectory(prefix="hyv4-warmup-") as tmp:
        started, running, ended = [], [], {}  # ended: process -> its end time, as noted
        try:
            started = _start_prefetch(list(prefetch), tmp)
            running = _start_wave(jobs[0], tmp, 0) if jobs[0] else []
            if meanwhile is not None:
                meanwhile()
            watch = [proc for _, proc, _, _ in started]
            _finish_wave(running, steps, log, t_origin, ended, watch)
            n = len(running)
            for wave in jobs[1:]:
                running = _start_wave(wave, tmp, n) if wave else []
                n += len(running)
                _finish_wave(running, steps, log, t_origin, ended, watch)
        except BaseException:  # a lane or the caller's check failed: the warmup is over, every process too
            for proc in [p for _, p, _, _ in started] + [r[2] for r in running]:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            raise
        steps += _wait_prefetch(started, log, t_origin, ended)
    return steps


def _start_wave(wave: list[dict], tmp: str, n: int) -> list[tuple]:
    """Start each lane of ``wave`` (numbered from ``n + 1``), one ``python -m harness warmup`` process each."""
    from ..production.engine.engine_env import engine_env

    running = []
    for lane in wave:
        n += 1
        report, out = os.path.join(tmp, f"lane{n}.json"), os.path.join(tmp, f"lane{n}.log")
        # an engine beside other lanes gets a fixed KV size: vLLM's memory profiling fails
        # when another lane frees GPU memory meanwhile (seen with vLLM 0.34.0); lanes side by
        # side split the cores as torch threads (nvcc, the prefetches' work, is not torch's pool)
        env = engine_env(bool(lane["engines"]) and len(wave) > 1, computing=len(wave))
        with open(out, "w") as f:
            proc = subprocess.Popen(_lane_command(lane["cases"], lane["engines"], report, lane.get("mutants", False)),
                                    stdout=f, stderr=subprocess.STDOUT, env=env)
        running.append((n, lane, proc, report, out, time.perf_counter()))
    return running


def _finish_wave(running: list[tuple], steps: list, log, t_origin: float, ended: dict | None = None,
                 watch: list = ()) -> None:
    """Wait for a wave's lanes (noting their end times, and those of ``watch``, in ``ended``);
    their steps to ``steps`` (each with its lane and the lane's ``lane_span_s``); the first failed
    lane is CannotJudge naming it and its last line."""
    failed, ended = [], {} if ended is None else ended
    _wait_ends([r[2] for r in running], ended, watch)
    for n_, lane, proc, report, out, t0 in running:
        if proc.returncode != 0:
            names = ", ".join(_lane_names(lane))
            failed.append(f"warmup lane {n_} ({names}): exit {proc.returncode}: {_last_line(out)}")
            continue
        span = [round(t0 - t_origin, 2), round(ended[proc] - t_origin, 2)]
        with open(report) as f:
            for st in json.load(f)["steps"]:
                steps.append({**st, "lane": n_, "lane_span_s": span})
                log(f"warmup {st['name']}: {st['seconds']:.1f} s (lane {n_})", flush=True)
    if failed:
        raise CannotJudge(failed[0])


def run(args, log=print) -> dict:
    """Warm every step (with ``--if-cold`` only those the stamp lacks); the report (per-step
    seconds, the steps skipped as warm, cache root and size, ``phases_s``: where this process's
    own time went). With lanes, where every wanted step is to be warmed whatever the versions
    (no ``--if-cold``, or a root with nothing stamped: a fresh host), the lead and the prefetches
    start before this process imports vLLM for its own checks, which run meanwhile."""
    t_origin = time.perf_counter()
    phases = {}
    set_vars = apply_jit_cache(args.cache)
    jit_cache.precompile_bytecode()  # --cache DIR: its bytecode layer (cli.main did $HYV4_JIT_CACHE's)
    root = os.environ.get(JIT_CACHE_ENV)
    phases["bytecode"] = round(time.perf_counter() - t_origin, 2)
    gpu_cases = case_registry.specs(kind="module", without="probe")
    engine_cases = case_registry.specs(kind="engine")

    only_other = getattr(args, "engine_only", False) or getattr(args, "mutants_only", False)
    cases = [] if only_other else args.case or list(gpu_cases)
    wanted = {cid: fingerprint(gpu_cases[cid]) for cid in cases}
    for eid in engines_of(args):
        wanted[eid] = fingerprint(engine_cases[eid])
    if mutants_wanted(args):
        wanted[MUTANTS_STEP] = mutants_fingerprint()
    rep = {"cache_root": root, "set": set_vars, "steps": [], "skipped_warm": [], "versions": None,
           "size_before": cache_size(root) if root else None}

    def checks():  # this process's own: can production run here, and on which versions
        t0 = time.perf_counter()
        reason = can_run.cannot_run_production_reason()
        if reason:
            raise CannotJudge(f"warmup: {reason}")
        from ..production.module.side_by_side import versions
        rep["versions"] = versions()
        phases["checks"] = round(time.perf_counter() - t0, 2)

    lanes_wanted = getattr(args, "lanes", 1) > 1
    all_cold = not getattr(args, "if_cold", False) or not (root and read_stamp(root).get("steps"))
    t_all = time.perf_counter()
    if lanes_wanted and all_cold and len(wanted) > 1 and can_run.gpu_device_nodes():
        lead, lanes = _plan_into(rep, cases, wanted, args)  # started at once, checked meanwhile
        rep["steps"] = run_lanes(lead, lanes, log, prefetch=rep["prefetch"], meanwhile=checks, t_origin=t_origin)
    else:
        rep["versions"] = _all_stamped_warm(wanted, root, args)
        if rep["versions"] is None:
            checks()
        todo = cold_steps(wanted, read_stamp(root), rep["versions"]) if getattr(args, "if_cold", False) \
            else dict(wanted)
        rep["skipped_warm"] = sorted(set(wanted) - set(todo))
        if lanes_wanted and len(todo) > 1:  # this process only plans and waits
            lead, lanes = _plan_into(rep, cases, todo, args)
            rep["steps"] = run_lanes(lead, lanes, log, prefetch=rep["prefetch"], t_origin=t_origin)
        else:
            _in_this_process(rep, cases, todo, args, root, log)
    rep["seconds"] = round(time.perf_counter() - t_all, 2)
    phases["work"] = rep["seconds"]
    if root:
        rep["size_after"] = cache_size(root)
    phases["total"] = round(time.perf_counter() - t_origin, 2)
    rep["phases_s"] = phases
    return rep


def _all_stamped_warm(wanted: dict, root: str | None, args) -> dict | None:
    """With ``--if-cold``: this host's versions when the root's stamp holds every wanted step warm
    for them, read without importing vLLM (its import and the production checks took 6-10 s of a
    GPU tier that then had nothing to warm); else None (the checks run as before)."""
    stamp = read_stamp(root) if root and getattr(args, "if_cold", False) else {}
    if not stamp.get("steps"):
        return None
    from ..production.module.side_by_side import versions

    quick = versions(import_vllm=False)
    return quick if not cold_steps(wanted, stamp, quick) else None


def _plan_into(rep: dict, cases: list[str], todo: dict, args) -> tuple[str | None, list[dict]]:
    """The lanes of ``todo`` -> (lead, lanes); the plan (lead, lanes, prefetches) recorded in ``rep``."""
    engines = [e for e in engines_of(args) if e in todo]
    lead, lanes = plan_lanes([c for c in cases if c in todo], engines, args.lanes, mutants=MUTANTS_STEP in todo)
    rep["lanes"] = [_lane_names(lane) for lane in lanes]
    rep["lead"] = lead
    rep["prefetch"] = plan_prefetch([c for c in cases if c in todo], bool(engines))
    return lead, lanes


def _in_this_process(rep: dict, cases: list[str], todo: dict, args, root, log) -> None:
    """Every step of ``todo`` in this process, in order, each stamped as it ends."""
    import torch

    gpu_cases = case_registry.specs(kind="module", without="probe")
    engine_cases = case_registry.specs(kind="engine")
    from ..production.module.reload import run_reload_case
    from ..production.module.side_by_side import run_production_side

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # reported with its name, exit 125
            raise CannotJudge(f"warmup {name}: {exc.__class__.__name__}: {str(exc).splitlines()[0][:300]}") from exc
        launchers = build_pending_launchers()  # what vLLM's JIT warmup compiled but did not launch
        dt = time.perf_counter() - t0
        rep["steps"].append({"name": name, "seconds": round(dt, 2), "launchers": launchers})
        log(f"warmup {name}: {dt:.1f} s", flush=True)
        if root:  # stamped as it goes: a later failure keeps what was warmed
            write_stamp(root, rep["versions"], {name: todo[name]})

    engines = [e for e in engines_of(args) if e in todo]

    def mutants_step():  # after the module cases here; with lanes, a lane of its own after the lead
        from ..mutants.driver import warm_catalogue
        rep["mutants"] = warm_catalogue()  # {"ran": n, "raised": [names]}: judged by the tier, not here

    for cid in (c for c in cases if c in todo):
        case = gpu_cases[cid]

        def module_level(case=case):
            try:
                if case.reload_seed is not None:  # its production side is vLLM's in-place reload, which a
                    run_reload_case(case)        # plain load never runs (its verdict is not looked at)
                else:
                    run_production_side(case)  # the side by side's production half; no reference, no verdict
            except Exception as exc:  # a case that exists to show a known vLLM gap stops at its load; a
                # reload vLLM refused is bisect-check's finding to judge (exit 1), not a host that cannot warm
                if not ((case.upstream_gaps or case.reload_seed is not None) and getattr(exc, "problems", None)):
                    raise
            torch.cuda.empty_cache()

        step(cid, module_level)
    if MUTANTS_STEP in todo:
        step(MUTANTS_STEP, mutants_step)
    for i, eid in enumerate(engines):
        if i == 0:  # the first engine in this process, as the module cases
            step(eid, lambda eid=eid: _warm_engine(engine_cases[eid]))
        else:  # a further vllm.LLM in one process is not what the tier runs: its own process each
            step(eid, lambda eid=eid: _engine_in_child(eid))


def _engine_in_child(eid: str) -> None:
    """One engine case warmed in a child ``warmup --engine-only`` (stamped there); its failure
    raised naming its last line."""
    with tempfile.TemporaryDirectory(prefix="hyv4-warmup-") as tmp:
        out = os.path.join(tmp, "engine.log")
        with open(out, "w") as f:
            rc = subprocess.call(_lane_command([], [eid], os.path.join(tmp, "engine.json")),
                                 stdout=f, stderr=subprocess.STDOUT)
        if rc != 0:
            raise RuntimeError(f"exit {rc}: {_last_line(out)}")


def cache_root(args) -> str | None:
    """The cache root ``args`` names: --cache, else $HYV4_JIT_CACHE (absolute), else None."""
    root = args.cache or os.environ.get(JIT_CACHE_ENV)
    return os.path.abspath(os.path.expanduser(root)) if root else None


def restore_pack(args, log=print) -> dict:
    """``--restore``: the pack put into the cache root for this host's key, or refused naming the
    key fields that differ (then not used: the steps compile). The report's ``restore`` entry."""
    return jit_pack.restore_logged(args.restore, cache_root(args), log=log)


def cmd_warmup(args) -> int:
    check_arguments(args)
    if getattr(args, "restore_only", False):
        restored = jit_pack.restore_with_bytecode(args.restore, cache_root(args))
        if args.report:
            from ..atomic import atomic_write_json

            atomic_write_json(args.report, {"cache_root": cache_root(args), "restore": restored, "steps": []})
        return EXIT_OK
    restored = restore_pack(args) if getattr(args, "restore", None) else None
    rep = run(args)
    if restored is not None:
        rep["restore"] = restored
    line = f"warmup: {len(rep['steps'])} steps in {rep['seconds']:.1f} s"
    if rep["skipped_warm"]:
        line += f" ({len(rep['skipped_warm'])} stamped warm for these versions, skipped)"
    if rep["cache_root"]:
        line += (f"; cache {rep['cache_root']}: {rep['size_before'] / 2**20:.0f} -> "
                 f"{rep['size_after'] / 2**20:.0f} MiB")
    if args.pack:
        versions = jit_pack.host_versions()
        rep["pack"] = jit_pack.write_pack(rep["cache_root"], args.pack, versions, args.part_bytes,
                                          info={"gpu": versions["gpu"]})
        line += (f"; packed {args.pack}: {rep['pack']['parts']} parts, {int(rep['pack']['bytes']) / 2**20:.0f} MiB, "
                 f"vLLM {versions['vllm']} on compute capability {versions['capability']}")
    if args.report:
        from ..atomic import atomic_write_json

        atomic_write_json(args.report, rep)
    print(line, flush=True)
    return EXIT_OK


__all__ = ["add_arguments", "cmd_warmup", "EXIT_CANNOT_JUDGE"]
