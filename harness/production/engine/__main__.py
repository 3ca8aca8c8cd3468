"""``python -m harness.production.engine``: the engine-path command (``harness.production.engine.run``)."""

import os
import sys

from harness.production.engine.run import main

if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the report is written: skip the in-process engine's teardown (a hang costs the GPU slot)
