"""The CPU tier's seeded weights drawn once per process: ``reference.weights.random_weights``
behind a bounded memo (the pytest plugin installs it on a host without a GPU, after collection).

The CPU tier drew the same weights again and again: 264 draws of 92 distinct (config, seed)
pairs in one run, ~14 of their ~25 s (2 workers) repeats of a draw the same process had made
(the tiny presets' float64 ``torch.randn``, ~2-3 ms per tensor). A draw is a pure function of
(config, seed, draw): its own ``torch.Generator``, explicit float64, shapes from the config. So
a repeat in the same process returns a copy of the first draw's tensors, value for value; every
caller gets its own clones (callers plant bugs in place), the memo keeps the originals.

Only ``draw="stream"`` (every golden's, the tiny cases'); ``"per-tensor"`` (real dims, and the
test that it gives the same values on 1 and 2 threads) always draws. At most ``MAX_BYTES`` are
kept (least recently used first out); a draw bigger than that is never kept. Only this pytest
process: the ``python -m harness`` subprocesses the tests start draw as before.
"""

from __future__ import annotations

import collections
import functools
import os
import sys

MAX_BYTES = 512 << 20
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # the project


def memoized(original, max_bytes: int = MAX_BYTES):
    """``original`` (``random_weights``) with the memo in front of its ``draw="stream"`` calls."""
    kept: collections.OrderedDict = collections.OrderedDict()
    size = [0]

    @functools.wraps(original)
    def random_weights(cfg, seed, *, draw: str = "stream", **kw):
        if draw != "stream" or kw:
            return original(cfg, seed, draw=draw, **kw)
        key = (type(cfg), repr(cfg), seed)
        hit = kept.get(key)
        if hit is None:
            hit = original(cfg, seed, draw=draw)
            nbytes = sum(t.nbytes for t in hit.values())
            if nbytes > max_bytes:
                return hit
            kept[key] = hit
            size[0] += nbytes
            while size[0] > max_bytes:
                _, old = kept.popitem(last=False)
                size[0] -= sum(t.nbytes for t in old.values())
        else:
            kept.move_to_end(key)
        return {name: t.clone() for name, t in hit.items()}

    random_weights.__wrapped_original__ = original
    return random_weights


def install() -> bool:
    """Put the memo in front of ``reference.weights.random_weights`` wherever this process holds
    it: the module, and every project module (``harness``, ``reference``, the tests) that bound the
    name at import. Only once ``reference.weights`` is imported (a run that never imported torch
    does not here). True when installed."""
    weights = sys.modules.get("reference.weights")
    if weights is None or hasattr(weights.random_weights, "__wrapped_original__"):
        return False
    original = weights.random_weights
    wrapped = memoized(original)
    for mod in list(sys.modules.values()):
        if not str(getattr(mod, "__file__", None) or "").startswith(_ROOT):
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                setattr(mod, attr, wrapped)
    return True
