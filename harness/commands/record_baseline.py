"""``python -m harness bisect-check --record-baseline DIR``: this host's baseline, recorded at the
known-good vLLM (``harness.goldens.baseline`` stores it), so that later commits are
judged with ``bisect-check --baseline DIR`` where no checked-in golden matches this platform.

Its flags are checked with bisect-check's (``bisect_check.validate_args``); ``harness.cli`` runs
``record_baseline_command`` in place of ``bisect_check.bisect_command`` when the flag is given.
"""

from __future__ import annotations

from harness.atomic import write_errors, write_failure
from harness.exitcodes import EXIT_OK
from harness.goldens import baseline as golden_baseline
from harness.goldens.platform_key import describe, describe_vllm

from .bisect_check import DEFAULT_BISECT_ENGINE_CASES, bisect_side_by_side, side_by_side_ids


def record_baseline_command(args) -> int:
    """``bisect-check --record-baseline DIR``: run the side-by-side cases (each still judged against
    the reference, and said so) and record their production traces as baseline DIR, all or nothing:
    0 when every case was recorded; a case that does not run records nothing (its code: 1 / 125)."""
    from harness.production.module.side_by_side import run_facts  # these import torch
    from harness.report import save_report

    ids = side_by_side_ids(args)
    left = [c for c in (args.case or DEFAULT_BISECT_ENGINE_CASES) if c not in ids]
    if left:
        print(f"engine case(s) {', '.join(left)}: not part of a baseline (vLLM's speculator is judged "
              "against its own expectations at every commit)")
    sbs = bisect_side_by_side(ids, None, None)
    if sbs.failed_line is not None:
        print(sbs.failed_line)
        print(f"nothing recorded: {args.record_baseline} is unchanged")
        return sbs.verdict
    if sbs.verdict != EXIT_OK:
        print("warning: a side-by-side case failed against the reference at this commit: the baseline records "
              "this vLLM as it is (the reference part of every later verdict still judges it)")
    try:
        stamp = golden_baseline.record(args.record_baseline, sbs.traces, force=getattr(args, "force", False))
    except write_errors() as exc:
        raise write_failure(f"--record-baseline {args.record_baseline}", exc) from exc
    print(f"recorded baseline {args.record_baseline}: {len(sbs.traces)} case(s) ({', '.join(sbs.traces)}), "
          f"platform {describe(stamp['platform'])}, {describe_vllm(stamp['recorded_with'])}; "
          f"judge later commits with: bisect-check --baseline {args.record_baseline}")
    if args.report:
        save_report(args.report, sbs.reports, {**run_facts(), "regimes": sbs.regimes,
                                                 "recorded_baseline": str(args.record_baseline)})
    return EXIT_OK
