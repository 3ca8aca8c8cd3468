"""``python -m harness``: run one command, then end the process without Python's teardown
(``harness.process_exit``: the verdict is decided, printed and written when ``main`` returns,
and a crash in teardown would replace the exit code that ``git bisect run`` reads).
"""

import sys

from .ci_speed.startup_gc import defer_gc

defer_gc()  # the program's start-up only (not where a test calls cli.main): resumed once vLLM is imported
from .ci_speed import model_info_prefetch  # noqa: E402
from .cli import main  # noqa: E402
from .process_exit import exit_now  # noqa: E402

try:
    code = main()
except KeyboardInterrupt:  # Ctrl-C before a command's guard was up (start-up): one line, as inside it
    print("interrupted (SIGINT): nothing half-written is left", file=sys.stderr)
    code = 130
try:
    model_info_prefetch.stop()  # the exit hooks of this package: a background inspection still running
finally:
    exit_now(code)  # and the rest (harness.process_exit)
