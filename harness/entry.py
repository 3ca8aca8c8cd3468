"""The program's entry: ``python -m harness`` (``harness/__main__.py``) and the console script
``hyv4-harness`` (``[project.scripts]``) both run ``run``: one command, then the process ends
without Python's teardown (``harness.process_exit``: the verdict is decided, printed and written
when ``main`` returns, and a crash or hang in vLLM's teardown would replace the exit code that
``git bisect run`` reads, or hold the GPU).
"""

from __future__ import annotations

import sys


def run() -> None:
    """Run ``harness.cli.main`` on ``sys.argv`` and end the process with its exit code."""
    from .ci_speed.startup_gc import defer_gc

    defer_gc()  # the program's start-up only (not where a test calls cli.main): resumed once vLLM is imported
    from .ci_speed import model_info_prefetch
    from .cli import main
    from .process_exit import exit_now

    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before a command's guard was up (start-up): one line, as inside it
        print("interrupted (SIGINT): nothing half-written is left", file=sys.stderr)
        code = 130
    try:
        model_info_prefetch.stop()  # the exit hooks of this package: a background inspection still running
    finally:
        exit_now(code)  # and the rest (harness.process_exit)
