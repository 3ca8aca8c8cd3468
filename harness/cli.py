"""``python -m harness <command>``: reference traces, synthetic checkpoints, comparisons.

Exit codes (``harness.exitcodes``, the same for every command): 0 good,
1 numeric mismatch or vLLM failed to load the checkpoint, 2 bad input (checked
first, on any machine), 125 cannot judge (no GPU, vLLM or kernel missing, an
unexpected error). Errors print one line; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .atomic import atomic_write, write_errors, write_failure
from .commands.passthrough import TOOLS, tool_call
from .exitcodes import (EXIT_CANNOT_JUDGE, EXIT_MISMATCH, EXIT_OK, EXIT_USAGE, CLIError,  # noqa: F401 - re-exported
                        OneLineParser)


def _load_case_inputs(args):
    """(hf_config, cfg, weights) from CKPT_DIR, a preset, or a named case."""
    from reference import MTPConfig, random_weights

    from .presets import preset

    if not args.ckpt.startswith("preset:"):
        from .checkpoint.loader import load_checkpoint

        loaded = load_checkpoint(args.ckpt)
        return loaded.hf_config, loaded.cfg, loaded.weights
    name = args.ckpt.split(":", 1)[1]
    try:
        hf = preset(name)
    except KeyError as exc:
        raise CLIError(str(exc.args[0])) from exc
    cfg = MTPConfig.from_hf_dict(hf)
    return hf, cfg, random_weights(cfg, args.seed)


# Upper bounds of the counts: what the float64 reference holds in memory stays well inside a
# 24 GiB machine, and no run takes minutes by mistake
MAX_STEPS = 32          # draft steps K (vLLM's MTP drafts a handful)
MAX_REQUESTS = 256
MAX_CASE_TOKENS = 16384  # requests x tokens: minutes of float64 reference on a CPU at most
MAX_CASE_ELEMENTS = 2 ** 24  # requests x tokens x hidden_size: 128 MiB per float64 activation, of which
                             # the trace keeps dozens (a 24 GiB machine stays well inside)
MAX_SIM_TP = 64


def _check_reference_args(args) -> None:
    """``reference``'s bad input, before torch is imported or a device is asked about (exit 2
    on any machine, in a fraction of a second): the checkpoint argument, the counts and their
    bounds, the seed, --out, and a preset's name (with its max_position_embeddings)."""
    from . import input_checks as check

    check.checkpoint(args.ckpt)
    if args.steps < 1 or args.requests < 1 or args.tokens < 1 or args.tp < 1:
        raise CLIError("--steps, --requests, --tokens and --tp must be >= 1")
    check.integer("--steps", args.steps, 1, MAX_STEPS)
    check.integer("--requests", args.requests, 1, MAX_REQUESTS)
    check.integer("--tp", args.tp, 1, MAX_SIM_TP)
    check.integer("--tokens", args.tokens, 1, MAX_CASE_TOKENS // args.requests,
                  f"--requests {args.requests} x --tokens must be <= {MAX_CASE_TOKENS}")
    check.seed("--seed", args.seed)
    check.output_file("--out", args.out)
    if not args.ckpt.startswith("preset:"):
        check.not_an_input("--out", args.out, args.ckpt)
    if args.ckpt.startswith("preset:"):
        from .presets import preset

        try:
            hf = preset(args.ckpt.split(":", 1)[1])
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
        _check_case_size(args, hf)


def _check_case_size(args, hf: dict) -> None:
    """--tokens within the model's max_position_embeddings (RoPE positions beyond it are not the
    model's), and the case's float64 activations within ``MAX_CASE_ELEMENTS``."""
    limit = hf.get("max_position_embeddings")
    if isinstance(limit, int) and args.tokens > limit:
        raise CLIError(f"--tokens {args.tokens}: more than {args.ckpt}'s max_position_embeddings {limit}")
    hidden = hf.get("hidden_size")
    if isinstance(hidden, int) and args.requests * args.tokens * hidden > MAX_CASE_ELEMENTS:
        raise CLIError(f"--requests {args.requests} x --tokens {args.tokens} x hidden_size {hidden} of {args.ckpt}: "
                       f"more than {MAX_CASE_ELEMENTS} (2**24) float64 elements per activation")


def cmd_reference(args) -> int:
    _check_reference_args(args)
    import torch
    from safetensors.torch import save_file

    from reference import draft, flatten, make_case, numerics_by_name

    out = Path(args.out)
    num = numerics_by_name(args.dtype)
    hf, cfg, weights = _load_case_inputs(args)
    _check_case_size(args, hf)
    from reference.tp import check_divisible

    try:
        check_divisible(cfg, args.tp)
    except ValueError as exc:
        raise CLIError(f"--tp {args.tp}: {exc}") from exc
    if args.device == "cuda" and not torch.cuda.is_available():  # asked once the input is known good
        from .exitcodes import CannotJudge

        raise CannotJudge("--device cuda: no CUDA device here")
    first = make_case(cfg, args.seed, args.requests, args.tokens).to(args.device)
    weights = {k: v.to(args.device) for k, v in weights.items()}
    t0 = time.perf_counter()
    result = draft(cfg, weights, first, args.steps, num, tp=args.tp)
    dt = time.perf_counter() - t0
    flat = {k: v.cpu().contiguous() for k, v in flatten(result).items()}
    meta = {"config": json.dumps(hf, sort_keys=True), "seed": str(args.seed), "dtype": args.dtype,
            "steps": str(args.steps)}
    try:
        atomic_write(out, lambda tmp: save_file(flat, tmp, metadata=meta))
    except write_errors() as exc:
        raise write_failure(f"--out {out}", exc) from exc
    toks = result.tokens.tolist()
    from .exitcodes import printable

    print(printable(f"reference: {len(flat)} tensors, {args.steps} step(s) x {args.requests} request(s), "
          f"{first.input_ids.numel()} step-0 tokens, dtype {args.dtype}, {dt:.2f}s, draft tokens {toks} -> {out}"))
    return EXIT_OK


# synth's bounds: the embedding and the LM head are built in float64 (vocab x hidden each)
MAX_MTP_LAYERS = 16
MAX_VOCAB_ELEMENTS = 2 ** 27  # 1 GiB per float64 table
MAX_SHARDS = 1000


def _check_synth_args(args) -> None:
    """``synth``'s bad input before torch is imported: OUT_DIR, the bounded counts, the seed."""
    from . import input_checks as check
    from .presets import preset

    from .atomic import check_replaceable

    check.replaceable_dir("OUT_DIR", args.out_dir)
    # what --force would remove: only a directory the harness wrote (its marker lists every file)
    check_replaceable(args.out_dir, args.force, f"OUT_DIR {args.out_dir}")
    check.integer("--mtp-layers", args.mtp_layers, 1, MAX_MTP_LAYERS, "num_nextn_predict_layers")
    check.integer("--shards", args.shards, 1, MAX_SHARDS)
    check.seed("--seed", args.seed)
    if args.vocab_size is not None:
        hidden = preset(args.preset)["hidden_size"]
        check.integer("--vocab-size", args.vocab_size, 1, MAX_VOCAB_ELEMENTS // hidden,
                      f"vocab_size x hidden_size {hidden} of preset {args.preset} <= 2**27: the float64 "
                      "embedding and LM head")


def cmd_synth(args) -> int:
    _check_synth_args(args)
    from .checkpoint.synth import synth_command

    return synth_command(args)


def _on_production(args, validate, run, start_early=None) -> int:
    """``run(args)`` (a command of ``harness.commands``) or exit 125 where production cannot run.

    Arguments are checked first (``validate``: a wrong flag is exit 2 on any machine)."""
    from .production import can_run
    from .production.engine.process import stop_engine_cases

    validate(args)
    # what the command starts in subprocesses that check the host themselves (bisect-check's
    # engines) starts now, beside this process's own checks; stopped if they fail
    early = start_early(args) if start_early is not None and can_run.gpu_device_nodes() else []
    try:
        reason = can_run.cannot_run_production_reason()
        if reason:
            print(f"cannot judge: {reason}")
            return EXIT_CANNOT_JUDGE
        from .production.kernel_paths import judged_without

        without = judged_without()  # a missing optional kernel, judged anyway on request: said first and last
        if without:
            print(f"warning: the verdict below is{without}")
        code = run(args, started=early) if early else run(args)
        if without:
            print(f"verdict: exit {code}{without}")
        return code
    finally:
        stop_engine_cases(early)  # those the command collected are stopped already


def cmd_compare(args) -> int:
    """Side by side on the GPU; 125 where production cannot run."""
    from .commands import compare
    from .commands.history import with_history

    return with_history("compare", args, lambda: _on_production(args, compare.validate_args, compare.compare_command))


def cmd_main_job(args) -> int:
    """The README's main job: side by side on the built-in synthetic case where a
    GPU is present; else the reference checked against its goldens. Its arguments are those of
    ``compare`` and are checked as such on any machine (bad input is exit 2 with or without a GPU).

    An explicit target (CKPT_DIR, a preset, a case id, ``--tp``, ``--steps``, ``--seed``) is what
    the user asked about: on a host without the production path it is validated (2 on bad input)
    and the verdict is 125, cannot judge; never the goldens' 0, which is about something else."""
    from .commands.compare import validate_args
    from .production import can_run

    explicit = [what for what, given in (
        (f"CKPT_DIR {args.ckpt}", args.ckpt is not None), (f"--tp {args.tp}", args.tp != 1),
        (f"--steps {args.steps}", args.steps is not None), (f"--seed {args.seed}", args.seed is not None)) if given]
    if args.ckpt is None:
        args.ckpt = DEFAULT_MAIN_TARGET
    validate_args(args)
    reason = can_run.cannot_run_production_reason()
    if reason is None:
        return cmd_compare(args)
    if explicit:
        from .exitcodes import printable

        print(printable(f"cannot judge: {' '.join(explicit)}: the input is valid (checked on this host), but its "
                        f"side by side needs the production path: {reason}"))
        return EXIT_CANNOT_JUDGE
    print(f"no production path here ({reason}): checking the reference against its goldens")
    from .goldens.reference import check_reference_goldens

    return check_reference_goldens(verbose=True, report=args.report)


DEFAULT_MAIN_TARGET = "preset:tiny"


def cmd_report(args) -> int:
    from .report import diff, format_table, plot, read_report

    from . import input_checks as check

    check.input_file("A.json", args.a)
    if args.b is not None:
        check.input_file("B.json", args.b)
    if args.plot is not None:  # checked before anything is printed: a bad --plot is bad input
        check.output_file("--plot", args.plot)
        check.not_an_input("--plot", args.plot, args.a, args.b)
        if not Path(args.plot).parent.is_dir():
            raise CLIError(f"--plot {args.plot}: directory {Path(args.plot).parent} does not exist")
    # a ratio of two errors: below 1 every error would count as moved, NaN/inf none
    if not (1 <= args.factor < float("inf")):
        raise CLIError(f"--factor {args.factor}: must be a finite number >= 1")
    try:
        a = read_report(args.a)
        b = read_report(args.b) if args.b else None
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    from .exitcodes import printable  # names and ids come from the report file: never raw to a terminal

    print(printable(format_table(a)))
    if args.plot:
        try:
            print(printable(f"plot: {plot(a, args.plot)}"))
        except write_errors() as exc:
            raise write_failure(f"--plot {args.plot}", exc) from exc
    if b is not None:
        moved = diff(a, b, args.factor)
        print(printable(f"\n{len(moved)} component(s) moved between {args.a} and {args.b}:"))
        for line in moved:
            print(printable("  " + line))
    return EXIT_OK


def cmd_bisect_check(args) -> int:
    """Side by side + goldens (or ``--baseline DIR``) for the default case set: 0 good, 1 bad,
    125 cannot judge (also: a golden part not judged, unless ``--allow-unjudged``);
    ``--record-baseline DIR`` records the baseline instead (``harness.commands.record_baseline``)."""
    from .commands import bisect_check, record_baseline
    from .commands.history import with_history

    if args.record_baseline:
        run, start_early = record_baseline.record_baseline_command, None
    else:
        run, start_early = bisect_check.bisect_command, bisect_check.start_early
    return with_history("bisect-check", args,
                        lambda: _on_production(args, bisect_check.validate_args, run, start_early))


def cmd_mutants(args) -> int:
    from . import input_checks as check

    if args.report is not None:
        check.output_file("--report", args.report)
    if args.budget_s is not None and not (0 < args.budget_s < float("inf")):
        raise CLIError(f"--budget-s {args.budget_s}: must be a finite number of seconds > 0")
    from .mutants import mutants_command

    return mutants_command(args)


def _add_side_by_side_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments shared by ``compare`` and ``main`` (which runs compare on a GPU)."""
    p.add_argument("ckpt", metavar="CKPT_DIR", nargs="?", default="preset:tiny",
                   help="a checkpoint directory, preset:NAME (seeded weights) or a GPU case id (none: preset:tiny)")
    p.add_argument("--steps", type=int, default=None,
                   help="draft steps K of a preset or checkpoint directory (default 2; refused with a case id)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: runs on that many GPUs, also vs TP=1")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the weights (presets) and of the inputs (default 0; refused with a case id)")
    p.add_argument("--report", default=None, help="write the JSON report here")


def _add_mutants_arguments(p) -> None:
    """``mutants``'s flags (here, not in harness.mutants: that package imports torch; the parser must not)."""
    p.add_argument("--list", action="store_true", help="print the catalogue and exit")
    p.add_argument("--speculator", action="store_true",
                   help="the planted bugs in vLLM's MTP speculator (harness.production.engine.speculator_mutants), "
                        "each through bisect-check on its engine case, plus pristine controls")
    p.add_argument("--only", nargs="+", action="extend", default=None, metavar="NAME",
                   help="run only these mutants")
    p.add_argument("--report", default=None, metavar="R.json", help="write the JSON report here")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no new run after S seconds (the rest is reported not-run)")
    p.add_argument("--no-control", action="store_true",
                   help="skip the unmutated control run of each case")


def build_parser() -> argparse.ArgumentParser:
    from .commands.history import add_history_argument

    p = OneLineParser(prog="python -m harness", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="print the traceback of an error (before its one line)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    r = sub.add_parser("reference", help="write the reference trace of a seeded case")
    r.add_argument("ckpt", metavar="CKPT_DIR", help="checkpoint directory, or preset:NAME for in-memory seeded weights")
    r.add_argument("--out", required=True, help="trace .safetensors (keys step{k}.{component})")
    r.add_argument("--steps", type=int, default=2, help="draft steps K")
    r.add_argument("--requests", type=int, default=2, help="requests in the batch")
    r.add_argument("--tokens", type=int, default=8, help="step-0 tokens per request")
    r.add_argument("--seed", type=int, default=0, help="seed of the weights (presets) and of the inputs")
    r.add_argument("--tp", type=int, default=1, help="simulated tensor parallelism")
    r.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the reference runs")
    r.add_argument("--dtype", choices=("float64", "production"), default="float64",
                   help="float64 (exact) or production (bf16 activations, fp32 accumulation)")
    r.set_defaults(func=cmd_reference)

    from .checkpoint.options import add_synth_arguments
    s = sub.add_parser("synth", help="write a synthetic HY V4 checkpoint")
    add_synth_arguments(s)
    s.set_defaults(func=cmd_synth)

    c = sub.add_parser("compare", help="vLLM's HYV4MTP vs the reference on a GPU (exit 0/1/2/125)")
    _add_side_by_side_arguments(c)
    add_history_argument(c)
    c.set_defaults(func=cmd_compare)

    rp = sub.add_parser("report", help="print a JSON report; with two, the components whose error moved")
    rp.add_argument("a", metavar="A.json", help="a report written by --report")
    rp.add_argument("b", metavar="B.json", nargs="?", help="a second report: list what moved from A to B")
    rp.add_argument("--plot", metavar="PNG", help="write a log-scale error-per-component plot of A")
    rp.add_argument("--factor", type=float, default=2.0, help="report max_abs changes larger than this ratio")
    rp.set_defaults(func=cmd_report)

    b = sub.add_parser("bisect-check", help="git-bisect verdict on vLLM: 0 good, 1 mismatch or load failure, "
                                            "2 bad input, 125 cannot judge")
    b.add_argument("--case", action="append", default=None, metavar="ID",
                   help="side-by-side or engine case to judge (default: the bisect set)")
    b.add_argument("--report", default=None, help="write the JSON report here")
    b.add_argument("--plant", default=None, metavar="MUTANT",
                   help="self-test of the harness: plant a known bug (`mutants --list`) in every case it "
                        "applies to before judging; a working bisect-check then exits 1")
    b.add_argument("--record-baseline", default=None, metavar="DIR",
                   help="at the known-good vLLM: record this host's baseline of the side-by-side cases into DIR "
                        "(all or nothing; judges nothing against a golden); 0 when every case was recorded")
    b.add_argument("--force", action="store_true",
                   help="with --record-baseline: replace an existing baseline DIR (never done without it)")
    b.add_argument("--baseline", default=None, metavar="DIR",
                   help="judge the production traces against the host baseline in DIR instead of the checked-in "
                        "goldens (same tolerances); recorded on another GPU, torch or CUDA: exit 2")
    b.add_argument("--graphs", action="store_true",
                   help="also judge vLLM's speculator under CUDA graphs as `vllm serve` runs it "
                        "(the graph-bisect cases: K = 3 with and without index sharing): "
                        "for a change to graph capture, padding or the "
                        "speculator's lifecycle hooks")
    b.add_argument("--compressed-tensors", action="store_true",
                   help="with --case: also judge the compressed-tensors channel-FP8 checkpoint "
                        "(tiny-k2-ct-fp8-channel-long, against the reference; the default set holds it)")
    b.add_argument("--reload", action="store_true",
                   help="with --case: also judge the drafter's weights updated in place through vLLM's layerwise "
                        "reload (tiny-k2-reload, against the reference; the default set holds it)")
    b.add_argument("--allow-unjudged", action="store_true",
                   help="exit 0, not 125, when the judged parts pass but a golden part could not be judged "
                        "(the NOT JUDGED lines stay)")
    add_history_argument(b)
    b.set_defaults(func=cmd_bisect_check)

    from .commands import autobisect as autobisect_cli, history as history_cli, nightly as nightly_cli
    h = sub.add_parser("history", help="the run history: table, trend plots, --drift (exit 1 on drift); merge, ingest")
    history_cli.add_arguments(h)
    h.set_defaults(func=history_cli.cmd_history)

    ab = sub.add_parser("autobisect", help="git bisect run over a vLLM source tree by itself: the culprit commit "
                                           "and its first divergent component (0 named, 2, 125)")
    autobisect_cli.add_arguments(ab)
    ab.set_defaults(func=autobisect_cli.cmd_autobisect)

    n = sub.add_parser("nightly", help="the nightly GPU job: tier, bisect-check, history, drift, autobisect on "
                                       "failure; everything to upload in OUT_DIR")
    nightly_cli.add_arguments(n)
    n.set_defaults(func=nightly_cli.cmd_nightly)

    mu = sub.add_parser("mutants", help="apply known-bug mutants to vLLM in process; 0 all detected, 1 not, 125")
    _add_mutants_arguments(mu)
    mu.set_defaults(func=cmd_mutants)

    w = sub.add_parser("warmup", help="compile the GPU stack's JIT kernels once per host (0 warmed, 2, 125)")
    from .ci_speed.warmup import add_arguments as add_warmup_arguments, cmd_warmup
    add_warmup_arguments(w)
    w.set_defaults(func=cmd_warmup)

    m = sub.add_parser("main", help="the main job: compare on a GPU, else reference goldens (an explicit "
                       "target without a GPU: validated, then 125)")
    _add_side_by_side_arguments(m)
    # None: nothing named (the built-in case); a target named on a host without a GPU is not
    # answered by the goldens check (cmd_main_job)
    m.set_defaults(ckpt=None)
    m.set_defaults(func=cmd_main_job)

    for name, (_, what) in TOOLS.items():  # listed here; run by main() with their own parsers (commands.passthrough)
        t = sub.add_parser(name, help=what, add_help=False,
                           description=f"{what}. Its arguments are its own: python -m harness {name} --help")
        t.add_argument("args", nargs="*", metavar="ARGS",
                       help=f"its own arguments and flags (python -m harness {name} --help)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error is one line and a contract exit code (``harness.exitcodes``)."""
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    tool = tool_call(argv)
    if tool is not None:  # a command with its own parser: its checks, its exit codes
        runner, rest = tool
        return runner(rest)
    from .exitcodes import run_guarded
    from .input_checks import environment
    from .ci_speed.jit_cache import apply_jit_cache, precompile_bytecode

    # the documented environment variables first: $HYV4_JIT_CACHE is used just below
    code = run_guarded(environment, debug="--debug" in argv)
    if code:
        return code
    # $HYV4_JIT_CACHE: every JIT layer under one root, before torch is first imported (the
    # parser imports it): a module imported earlier never reads the bytecode cached there
    apply_jit_cache()
    precompile_bytecode()  # a cold bytecode layer on a many-core host: all at once, not one by one
    args = build_parser().parse_args(argv)  # imports no torch
    from .ci_speed import model_info_prefetch
    if model_info_prefetch.wanted(args):
        model_info_prefetch.start()  # vLLM's model-class inspection, cold: beside the imports, not after them
    watch = _jit_watch(args)
    code = run_guarded(args.func, args, debug=args.debug)
    if watch is not None and code in (0, 1):  # a judged run: did it compile what a warmup should have?
        watch()
    return code


# the commands that run vLLM's kernels and judge them: with a cache root, each says at its end what
# it compiled there (every engine subprocess included), so a kernel a warmup misses is named at once
_JIT_WATCHED = ("cmd_bisect_check", "cmd_compare", "cmd_mutants", "cmd_main_job")


def _jit_watch(args):
    """With ``$HYV4_JIT_CACHE`` and a watched command: a callable printing ``compiled_line`` of the run."""
    import os

    from .ci_speed import jit_cache

    root = os.environ.get(jit_cache.JIT_CACHE_ENV)
    if not root or getattr(args.func, "__name__", "") not in _JIT_WATCHED or not os.path.isdir(root):
        return None
    before = jit_cache.snapshot(root)

    def report() -> None:
        try:
            built = jit_cache.compiled_since(before, jit_cache.snapshot(root))
        except OSError:
            return
        print(jit_cache.compiled_line(root, built), flush=True)
    return report
