"""Whether this is a CI run: no torch import here (the root conftest reads it in every pytest process)."""

from __future__ import annotations

import os


def ci_is_set(environ=None) -> bool:
    """Whether ``CI`` says this is a CI run (where ``--update-goldens`` is refused).

    Any non-empty value except an explicit no (0/false/no/off, any case) counts:
    CI systems set ``true``, ``1`` or ``yes``, and an unknown value errs on the
    side of not rewriting goldens."""
    value = (os.environ if environ is None else environ).get("CI", "").strip().lower()
    return value not in ("", "0", "false", "no", "off")
