"""``python -m harness.production.side_by_side``: the documented command path of
``harness.production.module.side_by_side`` (where the code lives)."""

import sys

from harness.ci_speed.jit_cache import apply_jit_cache

apply_jit_cache()  # $HYV4_JIT_CACHE, before vLLM is imported (as `python -m harness`)
from harness.production.module.side_by_side import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
