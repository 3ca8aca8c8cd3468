"""``python -m harness.production.side_by_side``: the documented command path of
``harness.production.module.side_by_side`` (where the code lives)."""

import sys

from harness.production.module.side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
