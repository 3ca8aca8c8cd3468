"""The mutants' common ground: ``Ctx`` (a loaded ``ProductionSession`` plus an undo stack),
the lookups the mutants share (``need``, ``_param``, ``_router``, ``_impl``, ``_walk``,
``_neox_copy``), ``Planted`` (one planted bug as a component module declares it), ``Mutant``
(a catalogue entry: a ``Planted`` with the component whose registry record lists it) and the GPU
cases the mutants run on."""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import torch

from harness.record_checks import RecordError, one_of
from harness.undo import UndoStack


class MutantNotApplicable(Exception):
    """The attribute/parameter a mutant needs does not exist in this build."""


class Ctx(UndoStack):
    """A loaded ``ProductionSession`` plus an undo stack (``harness.undo``) for attribute sets and hooks."""

    def __init__(self, session) -> None:
        super().__init__()
        self.session = session
        self.model = session.model
        self.hf = session.hf_config
        self.notes: list[str] = []

    # model parts (MTP layer 0 serves every proposer step)
    @property
    def layer(self):
        return next(iter(self.model.model.layers.values()))

    @property
    def attn(self):
        return self.layer.mtp_block.self_attn

    @property
    def mlp(self):
        return self.layer.mtp_block.mlp

    def setattr(self, obj, attr: str, value, *, must_exist: bool = True) -> None:
        if must_exist and not hasattr(obj, attr):
            raise MutantNotApplicable(f"{type(obj).__name__} has no attribute {attr!r}")
        super().setattr(obj, attr, value)

    def hook(self, handle) -> None:
        self.push(handle.remove)


def need(obj, attr: str, what: str = ""):
    """``getattr(obj, attr)`` or MutantNotApplicable naming what is missing."""
    v = getattr(obj, attr, None)
    if v is None:
        raise MutantNotApplicable(f"{what or type(obj).__name__}.{attr} is missing or None")
    return v


def _param(module, name: str = "weight") -> torch.Tensor:
    p = getattr(module, name, None)
    if not isinstance(p, torch.Tensor):
        raise MutantNotApplicable(f"{type(module).__name__}.{name} is not a tensor")
    if p.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise MutantNotApplicable(f"{type(module).__name__}.{name} is {p.dtype} (quantized): edit not defined")
    return p


def _router(ctx: Ctx):
    from harness.production.module.capture import _find_router

    r = _find_router(need(ctx.mlp, "experts", "mlp"))
    if r is None:
        raise MutantNotApplicable("no MoE router with select_experts under mlp.experts")
    return r


def _impl(ctx: Ctx):
    return need(ctx.attn.mla_attn, "impl", "mla_attn")


def _walk(root, max_depth: int = 6):
    """Objects reachable from ``root`` through modules and vLLM objects' attributes."""
    seen, stack = set(), [(root, 0)]
    while stack:
        obj, d = stack.pop()
        if obj is None or id(obj) in seen or d > max_depth or torch.is_tensor(obj):
            continue
        seen.add(id(obj))
        yield obj
        if isinstance(obj, (list, tuple)):
            stack.extend((x, d + 1) for x in obj)
            continue
        if isinstance(obj, dict):
            stack.extend((x, d + 1) for x in obj.values())
            continue
        mod = type(obj).__module__ or ""
        if not (mod.startswith("vllm") or isinstance(obj, torch.nn.Module)):
            continue
        try:
            attrs = vars(obj)
        except TypeError:
            continue
        for k, v in attrs.items():
            if k in ("_parameters", "_buffers"):
                continue
            if k == "_modules":
                stack.extend((x, d + 1) for x in v.values())
            elif isinstance(v, torch.nn.Module) or not callable(v):
                stack.append((v, d + 1))


def _neox_copy(ctx: Ctx, rope):
    """A fresh get_rope(..., is_neox_style=True) twin of ``rope`` (get_rope caches
    instances, and the MLA and indexer share one: never mutate the cached object)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import rotary_embedding as re_mod

    if getattr(rope, "is_neox_style", None) is not False:
        raise MutantNotApplicable(f"{type(rope).__name__}.is_neox_style is {getattr(rope, 'is_neox_style', None)!r}")
    cache = need(rope, "cos_sin_cache", type(rope).__name__)
    vc = ctx.session.vllm_config
    draft = getattr(getattr(getattr(vc, "speculative_config", None), "draft_model_config", None), "hf_config", None)
    params = getattr(draft, "rope_parameters", None) or ctx.hf["rope_parameters"]
    with set_current_vllm_config(vc):
        new = re_mod.get_rope(int(ctx.hf["qk_rope_head_dim"]),
                              max_position=int(getattr(ctx.attn, "max_position_embeddings", 8192)),
                              is_neox_style=True, rope_parameters=dict(params), dtype=cache.dtype)
    new = new.to(cache.device)
    if not new.is_neox_style or new is rope:
        raise MutantNotApplicable("get_rope did not return a NeoX-style twin")
    return new


# module cases of the registry (``harness.case_registry``) the mutants run on
K1, K3SHARE, LONG, LONGSHARE, HEADWISE, CLAMP, MODELOPT_DENSE = (
    "tiny-k1", "tiny-k3-share", "tiny-k2-long", "tiny-k3-long-share", "tiny-k2-headwise", "tiny-k2-clamp-headwise",
    "tiny-k2-modelopt-pb-dense")
FP8KV = "tiny-k2-long-fp8kv"  # served with an FP8 KV cache (fp8_ds_mla rows)
CT_CHANNEL = "tiny-k2-ct-fp8-channel-long"  # compressed-tensors channel FP8, ignore list with re: patterns


# the catalogue's groups (its tables and ``mutants --list`` group by them) and the CPU checks
# (``harness.mutants.cpu``) a mutant may name
MutantGroup = Literal["loading", "attention", "indexer", "moe", "multistep", "tp", "kv-cache"]
CpuCheck = Literal["rope", "routing", None]


def _check_mutant(where: str, m) -> None:
    """A planted bug names a known group, a known CPU check (with its patch) and a registry case."""
    from harness import case_registry

    one_of(where, "group", m.group, MutantGroup, "add the group to MutantGroup (the catalogue's tables list it)")
    one_of(where, "cpu_check", m.cpu_check, CpuCheck, "harness.mutants.cpu runs only these checks")
    if (m.cpu_check is None) != (m.cpu_apply is None):
        raise RecordError(f"{where}: cpu_check and cpu_apply go together (the check runs under the patch)")
    one_of(where, "case", m.case, case_registry.ids(kind="module", without="probe"),
           "declare the case in harness/case_registry.py (the one list of cases) or pick one there")


@dataclasses.dataclass(frozen=True)
class Planted:
    """One planted bug, as the module of its component declares it."""

    name: str
    stands_for: str
    case: str               # module case id of the registry (single GPU, not a probe)
    apply: Callable[[Ctx], None]
    group: MutantGroup
    cpu_apply: Callable | None = None     # context manager factory patching a pure vLLM function
    cpu_check: CpuCheck = None            # "rope" or "routing"
    # context manager factory active while the model is built and loaded (a bug in how vLLM
    # builds the draft: ``apply`` then has nothing left to do after loading)
    build_patch: Callable | None = None

    def __post_init__(self):
        _check_mutant(f"planted bug {self.name!r}", self)


@dataclasses.dataclass(frozen=True)
class Mutant:
    name: str
    stands_for: str
    component: str          # the canonical component that should flag it first
    case: str               # module case id of the registry (single GPU, not a probe)
    apply: Callable[[Ctx], None]
    group: MutantGroup
    cpu_apply: Callable | None = None     # context manager factory patching a pure vLLM function
    cpu_check: CpuCheck = None            # "rope" or "routing"
    build_patch: Callable | None = None   # active while the model is built and loaded

    def __post_init__(self):
        _check_mutant(f"mutant {self.name!r}", self)

    def row(self) -> dict:
        return {"name": self.name, "group": self.group, "stands_for": self.stands_for,
                "component": self.component, "case": self.case,
                "cpu": self.cpu_check or ""}
