"""``python -m harness``: run one command, then end the process without Python's teardown.

The verdict is decided, printed and written when ``main`` returns. What interpreter shutdown
does after that on a GPU host (vLLM's and torch's exit hooks, the NCCL process group's
destructor, module teardown) took 1.1-2.9 s of a warm ``harness main`` after its report line
(measured), and a crash there would replace the exit code that ``git
bisect run`` reads. So this package's own exit work is done, logging and stdio are flushed,
and the process ends with the command's code.
"""

import logging
import os
import sys

from .ci_speed.startup_gc import defer_gc

defer_gc()  # the program's start-up only (not where a test calls cli.main): resumed once vLLM is imported
from .ci_speed import model_info_prefetch  # noqa: E402
from .cli import main  # noqa: E402

try:
    code = main()
except KeyboardInterrupt:  # Ctrl-C before a command's guard was up (start-up): one line, as inside it
    print("interrupted (SIGINT): nothing half-written is left", file=sys.stderr)
    code = 130
try:
    model_info_prefetch.stop()  # the exit hooks of this package: a background inspection still running,
    from .production.process_temp import remove_process_temp_dir
    remove_process_temp_dir()  # and the vLLM model directories this process wrote
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    try:  # and what C/C++ code (vLLM's, torch's, NCCL's) printed into the C library's buffers
        import ctypes
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
finally:
    os._exit(code)
