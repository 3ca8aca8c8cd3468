"""Aten ops and host syncs per draft step of the float64 reference (CPU, no timing).

    ./with-env python benchmarks/bench_reference_ops.py [--presets tiny small] [--requests 8]
        [--tokens 64] [--steps 3] [--module reference]

On a GPU the reference is bound by the number of kernel launches and host
round trips, not by FLOPs, so this counts them on the CPU: every aten op
dispatched inside ``reference.draft`` (a ``TorchDispatchMode``), those that
are not views (about one kernel launch each on CUDA), and the ops that make a CUDA host wait for the
device: ``.item()`` / ``int()`` / ``bool()`` (``aten._local_scalar_dense``),
``.tolist()``, and ops whose output size depends on values (``nonzero``,
``unique``, ``masked_select``, boolean-mask indexing). Figures are per draft
step (the run's total / --steps). ``--module`` names the reference package to
count (``reference``; a frozen copy of an older one to compare).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.presets import preset

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "_unique2", "unique_dim", "unique_consecutive",
             "masked_select", "repeat_interleave"}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (by name) and host syncs while active."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        self.views += bool(func.is_view)
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
        sized = name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and any(
            isinstance(a, torch.Tensor) for a in args[1:2])
        if name in _SYNC_OPS - {"repeat_interleave"} or bool_index or sized:
            self.syncs[name + ("[bool]" if bool_index else "")] += 1
        return func(*args, **(kwargs or {}))


def count(ref, preset_name: str, requests: int, tokens: int, steps: int, overrides: dict | None = None):
    """(ops per step, syncs per step, top ops, top syncs) of ``ref.draft`` on one seeded case."""
    cfg = ref.MTPConfig.from_hf_dict(preset(preset_name, **(overrides or {})))
    w = ref.random_weights(cfg, 0)
    first = ref.make_case(cfg, 0, requests, tokens)
    num = ref.numerics_by_name("float64")
    tolist = torch.Tensor.tolist
    counter = OpCounter()

    def counted_tolist(self):
        counter.syncs["tolist"] += 1
        return tolist(self)

    torch.Tensor.tolist = counted_tolist
    try:
        with counter:
            ref.draft(cfg, w, first, steps, num, cache=ref.DraftCache())
    finally:
        torch.Tensor.tolist = tolist
    total = sum(counter.ops.values())
    return (total / steps, (total - counter.views) / steps, sum(counter.syncs.values()) / steps,
            counter.ops.most_common(8), counter.syncs.most_common(6), int(first.input_ids.numel()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="*", default=["tiny", "small"])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--module", default="reference")
    ap.add_argument("--detail", action="store_true", help="also print the most frequent ops and syncs")
    args = ap.parse_args()
    ref = importlib.import_module(args.module)
    print(f"{args.module}: float64, {args.requests} requests x ~{args.tokens} tokens, {args.steps} steps")
    print(f"{'preset':8s} {'tokens0':>8s} {'ops/step':>10s} {'non-view':>10s} {'syncs/step':>11s}")
    for name in args.presets:
        ops, kernels, syncs, top_ops, top_syncs, t0 = count(ref, name, args.requests, args.tokens, args.steps)
        print(f"{name:8s} {t0:8d} {ops:10.0f} {kernels:10.0f} {syncs:11.0f}")
        if args.detail:
            print("   ops:  ", ", ".join(f"{k} {v}" for k, v in top_ops))
            print("   syncs:", ", ".join(f"{k} {v}" for k, v in top_syncs))


if __name__ == "__main__":
    main()
