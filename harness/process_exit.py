"""End a process with its exit code and without Python's interpreter teardown.

Where a process's work is done (its verdict printed and written, or an xdist worker's results
sent), what teardown does after that on a GPU host (vLLM's and torch's exit hooks, the NCCL
process group's destructor, CUDA memory and context release, module teardown) costs seconds,
and a crash there would replace the exit code. So the harness's own exit work is done here
(the vLLM model directories this process wrote), logging and Python's and the C library's stdio
buffers are flushed, and the process ends with ``os._exit``. Measured: 1.1-2.9 s of a warm
``harness main`` after its report line; 3.8-5.0 s between the last GPU-tier xdist worker's end
and the controller's, which waits for each worker process to exit.
"""

from __future__ import annotations

import logging
import os
import sys


def exit_now(code: int) -> None:
    """Flush everything this process wrote and end it with ``code`` (never returns)."""
    try:
        from harness.production.process_temp import remove_process_temp_dir

        remove_process_temp_dir()  # os._exit skips the exit hook that would
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
