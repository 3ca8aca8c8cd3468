"""TEMPORARY (issue 44, delete after the merge): the module names the issue-44 restructure retired,
kept importable only for the files another part of the issue was editing at the same time (the
command layer ``harness/cli.py``, ``harness/commands/*``, the case modules and the
``python -m`` shims). Once those import the new names, delete this module and its one import
in ``harness/__init__.py``; nothing else uses it.

    harness.golden_check                        -> harness.goldens.reference
    harness.production.goldens                  -> harness.goldens
    harness.production.goldens.goldens_gpu      -> harness.goldens.production
    harness.production.goldens.baseline         -> harness.goldens.baseline
    harness.production.goldens.platform_key     -> harness.goldens.platform_key
    harness.production.engine.judge             -> harness.production.engine.generation_judge
    harness.production.engine.replay            -> harness.production.engine.draft_replay
    harness.compare                             -> harness.trace_compare
    harness.production.verdict[.judge|.replay]  -> harness.production.judging[.trace_judge|.teacher_forcing]
    ``from harness import goldens; goldens.X``  -> ``from harness.goldens import store; store.X``

An old name is an alias of the new module (the same object, imported on first use: nothing heavy
is imported before it is asked for).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD_TO_NEW = {
    "harness.golden_check": "harness.goldens.reference",
    "harness.production.goldens": "harness.goldens",
    "harness.production.goldens.goldens_gpu": "harness.goldens.production",
    # ``from harness.production.goldens import goldens_gpu``: the alias package's name is the new one
    "harness.goldens.goldens_gpu": "harness.goldens.production",
    "harness.production.goldens.baseline": "harness.goldens.baseline",
    "harness.production.goldens.platform_key": "harness.goldens.platform_key",
    "harness.production.engine.judge": "harness.production.engine.generation_judge",
    "harness.production.engine.replay": "harness.production.engine.draft_replay",
    "harness.compare": "harness.trace_compare",
    "harness.production.verdict": "harness.production.judging",
    "harness.production.verdict.judge": "harness.production.judging.trace_judge",
    "harness.production.verdict.replay": "harness.production.judging.teacher_forcing",
    "harness.production.verdict.tolerances": "harness.production.judging.tolerances",
    "harness.production.verdict.fp8_emulation": "harness.production.judging.fp8_emulation",
}


class _OldNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in OLD_TO_NEW else None

    def create_module(self, spec):
        return importlib.import_module(OLD_TO_NEW[spec.name])

    def exec_module(self, module):
        pass  # the new module ran when it was imported


def _goldens_store_attribute(name: str):
    """``harness.goldens.X`` for what the old module ``harness.goldens`` held (now ``store``)."""
    # a submodule not imported yet (``from harness.goldens import baseline`` asks first): not the store's
    if name.startswith("__") or name in ("store", "reference", "production", "platform_key", "baseline", "goldens_gpu"):
        raise AttributeError(f"module 'harness.goldens' has no attribute {name!r}")
    store = importlib.import_module("harness.goldens.store")
    try:
        return getattr(store, name)
    except AttributeError:
        raise AttributeError(f"module 'harness.goldens' has no attribute {name!r}") from None


def install() -> None:
    if not any(isinstance(f, _OldNames) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldNames())
    goldens = importlib.import_module("harness.goldens")  # a docstring only: nothing heavy
    goldens.__getattr__ = _goldens_store_attribute
