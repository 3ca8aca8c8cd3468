"""The catalogue: every planted bug, derived from the component registry
(``harness.components``: each record's ``mutants``), in dataflow order of the component each one
should flag first. The bugs themselves live in one module per component area (``mtp_io``,
``attention``, ``indexer``, ``moe``); adding one is a ``Planted`` there plus its name in its
component's record."""

from __future__ import annotations

from harness.components import REGISTRY

from . import attention, indexer, moe, mtp_io
from .base import Mutant

_PLANTED = {p.name: p for module in (mtp_io, attention, indexer, moe) for p in module.PLANTED}
_LISTED = [name for c in REGISTRY for name in (*c.mutants, *c.golden_mutants)]
if sorted(_PLANTED) != sorted(_LISTED):
    raise ImportError(f"planted bugs and the registry's disagree: only planted {sorted(set(_PLANTED) - set(_LISTED))}, "
                      f"only listed {sorted(set(_LISTED) - set(_PLANTED))}")

def _mutant(p, c) -> Mutant:
    return Mutant(p.name, p.stands_for, c.name, p.case, p.apply, p.group, p.cpu_apply, p.cpu_check, p.build_patch)


CATALOGUE: tuple[Mutant, ...] = tuple(_mutant(_PLANTED[name], c) for c in REGISTRY for name in c.mutants)

# below the reference tolerance: judged against a production golden / host baseline only
GOLDEN_CATALOGUE: tuple[Mutant, ...] = tuple(_mutant(_PLANTED[name], c) for c in REGISTRY for name in c.golden_mutants)

BY_NAME = {m.name: m for m in (*CATALOGUE, *GOLDEN_CATALOGUE)}


def select(only: list[str] | None) -> list[Mutant]:
    """The reference-verdict catalogue, or the named part of it (a golden-only bug is planted
    through ``bisect-check --plant`` against a baseline instead)."""
    if not only:
        return list(CATALOGUE)
    golden = [n for n in only if n in BY_NAME and n not in {m.name for m in CATALOGUE}]
    if golden:
        from harness.exitcodes import listed
        raise KeyError(f"{listed(golden, 5)}: below the reference tolerance, judged against a golden or baseline only: "
                       f"plant it with bisect-check --baseline DIR --plant NAME")
    unknown = [n for n in only if n not in BY_NAME]
    if unknown:
        from harness.exitcodes import listed
        raise KeyError(f"unknown mutant(s) {listed(unknown, 5)}; --list shows the catalogue")
    return [BY_NAME[n] for n in only]


def format_list() -> str:
    lines = [f"{'name':26s} {'component':21s} {'case':19s} {'cpu':8s} stands for"]
    for m in CATALOGUE:
        lines.append(f"{m.name:26s} {m.component:21s} {m.case:19s} {m.cpu_check or '':8s} {m.stands_for}")
    lines.append("golden / baseline only (bisect-check --baseline DIR --plant NAME):")
    for m in GOLDEN_CATALOGUE:
        lines.append(f"{m.name:26s} {m.component:21s} {m.case:19s} {'':8s} {m.stands_for}")
    return "\n".join(lines)
