"""cProfile one ``python -m harness`` command (``engine`` included), started the way
``python -m harness`` starts it.

    python benchmarks/profile_command.py OUT_PREFIX COMMAND [ARGS...]
    e.g. python benchmarks/profile_command.py /tmp/bisect bisect-check --report /tmp/bisect.json
         python benchmarks/profile_command.py /tmp/engine engine --case engine-accept-k3-share --out /tmp/e

Writes OUT_PREFIX.pstats (``python -m pstats``) and OUT_PREFIX.txt (the top functions by
cumulative and by own time), then ends the process with the command's exit code and without
interpreter teardown, as ``harness/__main__.py`` does (``harness.process_exit``, which would lose a
profile taken around it, hence this script). The main thread only: the engine subprocesses of
``bisect-check`` and vLLM's background threads are not in it. cProfile's own overhead inflates
Python-heavy frames; read the ranking, not the absolute seconds.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys

# sys.path as `python -m harness` run from the repo root has it (the root first, not benchmarks/):
# the package-map cache under the JIT cache root is keyed by sys.path, and a different key is a miss
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    prefix, args = argv[0], argv[1:]
    prof = cProfile.Profile()
    prof.enable()
    from harness.ci_speed.startup_gc import defer_gc

    defer_gc()  # as harness/__main__.py starts every command, the engine included
    from harness.ci_speed import model_info_prefetch  # its import starts the prefetch, as in __main__
    from harness.cli import main as harness_main

    code = harness_main(args)
    prof.disable()
    prof.dump_stats(prefix + ".pstats")
    with open(prefix + ".txt", "w") as f:
        for key in ("cumulative", "tottime"):
            f.write(f"==== by {key}\n")
            pstats.Stats(prof, stream=f).sort_stats(key).print_stats(70)
    model_info_prefetch.stop()
    return code


if __name__ == "__main__":
    from harness.process_exit import exit_now

    exit_now(main(sys.argv[1:]))
