"""``python -m harness.production.goldens_gpu``: the documented command path of
``harness.production.goldens.goldens_gpu`` (where the code lives)."""

import sys

from harness.ci_speed.jit_cache import apply_jit_cache

apply_jit_cache()  # $HYV4_JIT_CACHE, before vLLM is imported (as `python -m harness`)
from harness.production.goldens.goldens_gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
