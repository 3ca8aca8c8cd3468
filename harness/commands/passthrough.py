"""The commands of ``python -m harness`` that keep an argument parser of their own (``harness.cli``
lists them and hands them everything after their name, before the rest of the CLI runs):

    engine, goldens, side-by-side, speculator-mutants, fp8-emulation, kv-fp8-emulation,
    ci timeline | schedule | prefetch, autobisect-step

``python -m harness NAME --help`` is the command's own help; its exit codes are its own (the
contract of ``harness.exitcodes``).
"""

from __future__ import annotations

import importlib
import sys

from harness.ci_speed.jit_cache import apply_jit_cache  # cheap: no torch, vLLM or transformers
from harness.exitcodes import EXIT_OK, EXIT_USAGE, printable


def _deferred(module: str, func: str = "main", *, jit_cache: bool = False):
    """A runner that imports ``module`` when it runs, never before (the CLI's start-up imports no
    torch or vLLM; the engine checks its arguments before it imports them), then calls its ``func``
    with the arguments. ``jit_cache``: $HYV4_JIT_CACHE applied first, before torch and vLLM are imported."""
    def run(argv: list[str]) -> int:
        if jit_cache:
            apply_jit_cache()
        return getattr(importlib.import_module(module), func)(argv)

    return run


_run_engine = _deferred("harness.commands.engine", jit_cache=True)
_run_goldens = _deferred("harness.goldens.production", jit_cache=True)
_run_side_by_side = _deferred("harness.production.module.side_by_side", jit_cache=True)
_run_fp8_emulation = _deferred("harness.production.judging.fp8_emulation")
_run_kv_fp8_emulation = _deferred("harness.production.judging.kv_fp8_emulation")
_run_autobisect_step = _deferred("harness.commands.autobisect", "step_main")
_run_ci_timeline = _deferred("harness.ci_speed.pytest_timeline")
_run_ci_schedule = _deferred("harness.ci_speed.xdist_schedule")
_run_ci_prefetch = _deferred("harness.ci_speed.model_info_prefetch", "inspect_main")


def _run_speculator_mutants(argv: list[str]) -> int:
    """The planted speculator bugs (``harness.production.engine.speculator_mutants``), each through
    bisect-check on its engine case, plus pristine controls: 0 all caught and named first, 1, 125."""
    from harness import input_checks as check
    from harness.exitcodes import CLIError, OneLineParser
    from harness.production.engine.speculator_mutants import MUTANTS, run_catalogue

    ap = OneLineParser(prog="python -m harness speculator-mutants",
                       description="planted speculator bugs through bisect-check (GPU host)")
    ap.add_argument("--mutant", action="append", choices=sorted(MUTANTS))
    ap.add_argument("--report", default=None, metavar="R.json")
    args = ap.parse_args(argv)
    if args.report is not None:
        try:
            check.output_file("--report", args.report)
        except CLIError as exc:  # bad input: one line, exit 2, before the GPU question
            ap.error(str(exc))
    from harness.production.can_run import cannot_run_engine_reason

    reason = cannot_run_engine_reason()
    if reason:
        print(f"cannot judge: {reason}")
        return 125
    doc = run_catalogue(args.mutant, report=args.report)
    s = doc["summary"]
    print(f"speculator mutants: {s['caught']}/{s['mutants']} caught (bisect-check exit 1), "
          f"{s['named_first']}/{s['mutants']} named first; controls {'ok' if s['controls_ok'] else 'FAILED'}")
    return 0 if s["caught"] == s["mutants"] and s["named_first"] == s["mutants"] and s["controls_ok"] else 1


# ``python -m harness ci VERB``: the CI-speed machinery's own commands (harness/ci_speed/README.md)
CI_VERBS = {
    "timeline": (_run_ci_timeline, "DIR: where each process of a pytest run recorded with $HYV4_TIMELINE=DIR "
                                   "spent its wall time"),
    "schedule": (_run_ci_schedule, "JUNIT.xml DEST.json 'which run': record a GPU tier's test durations for "
                                   "the xdist schedule (tests/gpu/durations.json)"),
    "prefetch": (_run_ci_prefetch, "KEY: vLLM's model-class inspection, the background process a GPU command "
                                   "starts (not run by hand)"),
}


def _run_ci(argv: list[str]) -> int:
    usage = "usage: python -m harness ci {" + ",".join(CI_VERBS) + "} ..."
    if argv[:1] in (["-h"], ["--help"]):
        print("\n".join([usage, ""] + [f"  {verb} {what}" for verb, (_, what) in CI_VERBS.items()]))
        return EXIT_OK
    if not argv or argv[0] not in CI_VERBS:
        got = f"unknown command {argv[0]!r}" if argv else "a command is required"
        print(printable(f"error: python -m harness ci: {got}; choose from {', '.join(CI_VERBS)}"), file=sys.stderr)
        return EXIT_USAGE
    runner, what = CI_VERBS[argv[0]]
    if argv[1:] in (["-h"], ["--help"]):  # these take positional arguments only: their usage line
        print(f"usage: python -m harness ci {argv[0]} {what}")
        return EXIT_OK
    return runner(argv[1:])


TOOLS = {
    "engine": (_run_engine, "vLLM's own MTP speculator (vllm.LLM), one engine case per process: every draft "
                            "forward recorded and replayed by the reference (0/1/2/125); --rejudge on CPU"),
    "goldens": (_run_goldens, "production goldens of this platform: list, record, check (0/1/2/125)"),
    "side-by-side": (_run_side_by_side, "the side-by-side cases by set (--fp8, --modelopt, --compressed-tensors, "
                                        "--reload), traces saved; --rejudge on CPU (0/1/125)"),
    "speculator-mutants": (_run_speculator_mutants, "the planted speculator bugs, each through bisect-check "
                                                    "on its engine case, plus controls (0 all caught, 1, 125)"),
    "fp8-emulation": (_run_fp8_emulation, "CPU: emulate vLLM's block-FP8 path to estimate the FP8 tolerances"),
    "kv-fp8-emulation": (_run_kv_fp8_emulation, "CPU: emulate an FP8 KV cache to estimate its tolerances"),
    "ci": (_run_ci, "the CI-speed tools: timeline DIR | schedule JUNIT DEST WHICH | prefetch KEY"),
    "autobisect-step": (_run_autobisect_step, "one step of autobisect, as `git bisect run` runs it "
                                              "(--step CONFIG; started by autobisect)"),
}


def tool_call(argv: list[str]) -> tuple | None:
    """(runner, its arguments) when ``argv`` names one of ``TOOLS`` (after the global ``--debug``,
    which is handed on to it), else None."""
    lead = 0
    while lead < len(argv) and argv[lead] == "--debug":
        lead += 1
    if lead < len(argv) and argv[lead] in TOOLS:
        return TOOLS[argv[lead]][0], argv[:lead] + argv[lead + 1:]
    return None
