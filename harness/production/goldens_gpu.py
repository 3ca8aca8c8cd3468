"""``python -m harness.production.goldens_gpu``: the documented command path of
``harness.production.goldens.goldens_gpu`` (where the code lives)."""

import sys

from harness.production.goldens.goldens_gpu import main

if __name__ == "__main__":
    sys.exit(main())
