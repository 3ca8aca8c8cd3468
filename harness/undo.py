"""Attribute changes and hooks undone in reverse order: how a planted bug is taken out again.

Both kinds of planted bugs use it: the module-level mutants (``harness.mutants``: attributes
and hooks of a live ``HYV4MTP``) and the speculator mutants
(``harness.production.engine.speculator_mutants``: methods of vLLM's speculator classes and
functions of their modules, which a live engine looks up at call time).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable


class UndoStack:
    """``setattr`` and ``push`` record how to undo; ``restore`` undoes, newest first."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, obj, attr: str, value) -> None:
        """``obj.attr = value``, undone by putting back what ``obj`` itself held (the raw
        class-dict entry, so a staticmethod stays one) or, where the attribute was inherited
        or absent, by deleting it again."""
        own = getattr(obj, "__dict__", {})
        had = attr in own or _module_slot(obj, attr)
        old = own[attr] if attr in own else getattr(obj, attr, None)
        _force_setattr(obj, attr, value)

        def undo():
            if had:
                _force_setattr(obj, attr, old)
            else:
                with contextlib.suppress(AttributeError):
                    delattr(obj, attr)
        self._undo.append(undo)

    def push(self, undo: Callable[[], None]) -> None:
        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            fn = self._undo.pop()
            with contextlib.suppress(Exception):
                fn()


def _module_slot(obj, attr: str) -> bool:
    """An ``nn.Module``'s submodule, parameter or buffer (kept outside its ``__dict__``)."""
    return any(attr in getattr(obj, d, {}) for d in ("_modules", "_parameters", "_buffers"))


def _force_setattr(obj, attr, value) -> None:
    try:
        setattr(obj, attr, value)
    except (AttributeError, dataclasses.FrozenInstanceError, TypeError):
        object.__setattr__(obj, attr, value)
