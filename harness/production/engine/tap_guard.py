"""What every engine tap shares: a hook that raises never breaks vLLM's engine; it is recorded.

May import: nothing of the harness.
"""

from __future__ import annotations

import traceback

MAX_ERRORS = 20


class Guarded:
    """``self.errors``: the tracebacks of the tap's hooks that raised (the first ``MAX_ERRORS``);
    the verdict counts them (``tap_errors``), so a tap that failed never passes silently."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def _guard(self, what: str, fn) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - never break the engine; report it
            if len(self.errors) < MAX_ERRORS:
                self.errors.append(f"{what}: {traceback.format_exc()}")
