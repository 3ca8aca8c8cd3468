"""Exact loader of HY V4 MTP checkpoints onto the reference's canonical float64 weights.

``load_checkpoint(dir)`` reads ``config.json`` and ``model.safetensors.index.json``
(or a single ``model.safetensors``), opens only the shards that hold MTP
tensors, the embedding and the LM head, and reads those tensors one by one
(``os.pread`` of the span the checked header gives: no memory map, so a shard truncated
while it is read is a short read named, not a SIGBUS): backbone tensors are never read. The
header of every shard the index lists is parsed (a few KB each) and checked entry by entry
(dtype, shape, ``data_offsets`` that overlap, leave holes or lie; a tensor listed twice): a tensor held by two
shards, an MTP tensor a shard holds but the index does not list (vLLM reads
every tensor of every listed shard, so it would load those too) and a shard
shorter than its header says are refused before anything is read. Both namings
(``model.mtp_layers.<i>`` / ``model.layers.<N+i>``), both routed-expert layouts
(split / fused) and block FP8 (float32 scales, UE8M0 as uint8 bytes, e8m0 or
power-of-two float32, expert ``.scale`` names; ModelOpt ``FP8_PB_WO`` with 4-D
``weight_scale``; compressed-tensors channel / block FP8 with ``weight_scale``, split experts)
are accepted, each module in FP8 or bf16 exactly as the config's exclusion list
(``modules_to_not_convert`` / ``ignored_layers`` / ``exclude_modules``, wildcards included;
compressed-tensors' ``ignore`` as the checkpoint means it, exact names and ``re:`` patterns)
says it is stored; FP8 is dequantized
exactly (e4m3 value x scale in float64). Anything else is a ``CheckpointError``
naming the file, the tensor and the problem, including checkpoints vLLM 0.33
would load wrongly or silently incompletely (``strict_vllm``).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from pathlib import Path

import torch

from reference.config import ConfigError, MTPConfig
from reference.fp8 import dequantize_block
from reference.weights import FP32_PARAMS, layer_shapes, shapes

from .errors import CheckpointError
from .names import SHARED, checkpoint_leaf, known_leaves, layer_prefix, parse_layer_name
from .shards import SINGLE, _dt, _load_json, _locate, _Reader, _st_dtype
from .quant import CT_METHOD, Fp8Plan, decode_scale, mtp_fp8_plan, vllm_reinterprets_uint8


_SPLIT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)"
                    r"\.(weight|weight_scale_inv|weight_scale|scale)$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)(|_scale_inv|\.weight_scale_inv|\.scale)$")
_EXPERT_PROJ = ("gate_proj", "up_proj", "down_proj")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass
class Fp8Source:
    """How an FP8-stored canonical tensor was stored (for vLLM-side rounding)."""

    block: tuple[int, int]
    scale_dtype: str


@dataclasses.dataclass
class LoadedCheckpoint:
    path: Path
    hf_config: dict
    cfg: MTPConfig
    weights: dict[str, torch.Tensor]  # canonical name -> float64
    source: dict[str, list[str]]  # canonical name -> checkpoint tensor names it came from
    fp8: dict[str, Fp8Source] = dataclasses.field(default_factory=dict)
    files_read: list[str] = dataclasses.field(default_factory=list)
    ignored: list[str] = dataclasses.field(default_factory=list)  # MTP names vLLM skips too

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors behind ``weights`` as stored (FP8 stays FP8, scales as on disk).

        What vLLM's ``load_weights`` would be fed for the MTP head: every name in
        ``source`` (embedding, LM head, MTP layers), read again from the files.
        """
        where, index_file = _locate(self.path)
        rd = _Reader(self.path, where, index_file)
        return {n: rd.read(n)[1] for n in sorted({n for v in self.source.values() for n in v})}

    def vllm_weights(self) -> dict[str, torch.Tensor]:
        """``weights`` as vLLM 0.33 holds them after loading, where that differs.

        The indexer's ``wk`` stored in FP8 is dequantized by vLLM into its bf16
        fused ``wk_weights_proj``: float32(q) * float32(s), rounded to bf16.
        Every other FP8 tensor stays FP8 in vLLM (its exact value is q * s).
        """
        out = dict(self.weights)
        for name, src in self.fp8.items():
            if name.endswith(".indexer.wk"):
                out[name] = self.weights[name].to(torch.float32).to(torch.bfloat16).to(torch.float64)
        return out


def _classify(leaf: str):
    """Per-layer checkpoint leaf -> (canonical leaf, role, key) or None when unknown.

    role: "weight" or "scale"; key distinguishes tensors of one canonical leaf
    (expert index, fused part).
    """
    m = _SPLIT.match(leaf)
    if m:
        e, proj, suffix = m.groups()
        return f"mlp.experts.{proj}", ("weight" if suffix == "weight" else "scale"), ("split", int(e))
    m = _FUSED.match(leaf)
    if m:
        proj, suffix = m.groups()
        return (f"mlp.experts.{'gate_up' if proj == 'gate_up_proj' else 'down_proj'}",
                "weight" if suffix == "" else "scale", ("fused",))
    for k in _ALL_LEAVES:
        v = checkpoint_leaf(k)
        if leaf == v:
            return k, "weight", ()
        if v.endswith(".weight") and leaf in (v.removesuffix(".weight") + ".weight_scale_inv",
                                              v.removesuffix(".weight") + ".weight_scale"):
            return k, "scale", ()
    return None


_ALL_LEAVES = tuple(
    k for k in ("enorm", "hnorm", "eh_proj", "final_layernorm", "input_layernorm",
                "post_attention_layernorm", "attn.q_a_proj", "attn.q_a_layernorm", "attn.q_b_proj",
                "attn.kv_a_proj_with_mqa", "attn.kv_a_layernorm", "attn.kv_b_proj", "attn.o_proj",
                "attn.linear_gate", "attn.sink", "indexer.wq_b", "indexer.wk", "indexer.weights_proj",
                "indexer.k_norm.weight", "indexer.k_norm.bias", "mlp.gate", "mlp.expert_bias",
                "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj",
                "mlp.shared_experts.down_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def _hint(leaf: str) -> str:
    cands = list(known_leaves()) + [f"mlp.experts.0.{p}.weight" for p in _EXPERT_PROJ] + \
        ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    close = difflib.get_close_matches(leaf, cands, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def load_checkpoint(ckpt_dir: str | os.PathLike, *, strict_vllm: bool = True) -> LoadedCheckpoint:
    """Read a HY V4 MTP checkpoint into canonical float64 weights, validating everything.

    ``strict_vllm`` also refuses checkpoints vLLM 0.33 loads wrongly or
    incompletely without an error: uint8 UE8M0 bytes in a linear scale
    (copied numerically), and ``model.layers.<N+i>`` tensors that
    ``_get_spec_layer_idx_from_weight_name`` ignores (i >= max(num_nextn_predict_layers - 1, 1)).

    Steps, in order (the first problem found is the one raised): the config; where each tensor
    is (no tensor read yet); every MTP name classified; tensors the config does not call for;
    the shared tensors; each MTP layer's tensors (routed experts last); scales no weight used.
    """
    root = Path(ckpt_dir)
    hf, cfg, plan, model_dtype = _read_config(root)
    where, index_file = _locate(root, cfg.num_hidden_layers)
    rd = _Reader(root, where, index_file)
    rd.model_dtype = model_dtype
    listing = index_file or root / SINGLE
    found, ignored = _classify_names(rd, where, cfg, strict_vllm)
    _refuse_extras(rd, found, cfg)
    weights: dict[str, torch.Tensor] = {}
    source: dict[str, list[str]] = {}
    fp8_src: dict[str, Fp8Source] = {}
    _load_shared(rd, found, shapes(cfg), model_dtype, listing, weights, source)
    for i in range(cfg.num_mtp_layers):
        # name missing tensors the way the layer's other tensors are named
        some = next((n for k, n in found.items() if k[0] == i), None)
        pfx = layer_prefix(cfg, i, parse_layer_name(some, cfg.num_hidden_layers)[1] if some else "mtp_layers")
        _load_layer(rd, found, i, cfg, hf, plan, model_dtype, strict_vllm, pfx, listing, weights, source, fp8_src)
        if cfg.mlp_moe:
            _load_experts(rd, found, i, cfg, plan, strict_vllm, weights, source, fp8_src, pfx, listing)
    for (i, canon, role, key), name in found.items():
        if i is not None and role == "scale" and not any(name in v for v in source.values()):
            raise CheckpointError(rd.path(name), name, "a scale whose weight is not FP8 or not present")
    return LoadedCheckpoint(path=root, hf_config=hf, cfg=cfg, weights=weights, source=source,
                            fp8=fp8_src, files_read=sorted(rd.handles), ignored=sorted(ignored))


def _read_config(root: Path) -> tuple[dict, MTPConfig, Fp8Plan | None, torch.dtype]:
    """Step 1: ``config.json`` read and checked (hf dict, the reference's config, the FP8 plan, the
    model dtype the plain tensors are stored in)."""
    if not root.is_dir():
        raise CheckpointError(root, None, "is not a directory")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(cfg_path, None, "is not a regular file" if os.path.lexists(cfg_path) else "missing")
    hf = _load_json(cfg_path, "config.json")
    if not isinstance(hf, dict):
        raise CheckpointError(cfg_path, None, "is not a JSON object")
    try:
        cfg = MTPConfig.from_hf_dict(hf)
    except (ConfigError, TypeError, ValueError) as exc:
        raise CheckpointError(cfg_path, None, f"config the reference cannot run: {exc}") from exc
    try:
        plan = mtp_fp8_plan(hf, cfg)
    except ValueError as exc:
        raise CheckpointError(cfg_path, None, str(exc)) from exc
    model_dtype = _DTYPES.get(str(hf.get("torch_dtype", hf.get("dtype", "bfloat16"))), torch.bfloat16)
    return hf, cfg, plan, model_dtype


def _classify_names(rd: _Reader, where: dict[str, str], cfg: MTPConfig,
                    strict_vllm: bool) -> tuple[dict[tuple, str], list[str]]:
    """Step 2 (no file is opened yet): (layer, canon, role, key) -> checkpoint name for every MTP
    and shared tensor, and the MTP names vLLM skips too; backbone names are never read."""
    n_hidden = cfg.num_hidden_layers
    # vLLM's _get_spec_layer_idx_from_weight_name: model.layers.<N+i> only for these i
    vllm_layers_seen = max(cfg.num_nextn_predict_layers - 1, 1) if cfg.num_nextn_predict_layers >= 1 else 0
    found: dict[tuple, str] = {}  # (layer, canon, role, key) -> checkpoint name
    ignored: list[str] = []
    for name in where:
        if name in SHARED:
            found[(None, SHARED[name], "weight", ())] = name
            continue
        parsed = parse_layer_name(name, n_hidden)
        if parsed is None:
            continue  # backbone: never read
        i, naming, leaf = parsed
        if leaf.startswith(("embed_tokens.", "shared_head.")):
            ignored.append(name)
            continue
        if i >= cfg.num_mtp_layers:
            raise CheckpointError(rd.path(name), name,
                                  f"belongs to MTP layer {i}, but config.json's num_nextn_predict_layers="
                                  f"{cfg.num_nextn_predict_layers} builds {cfg.num_mtp_layers} MTP layer(s)")
        if strict_vllm and naming == "layers" and i >= vllm_layers_seen:
            raise CheckpointError(rd.path(name), name,
                                  f"vLLM 0.33 ignores model.layers.<{n_hidden}+{i}> MTP tensors "
                                  f"(it reads model.layers.<N+i> only for i < max(num_nextn_predict_layers-1, 1)"
                                  f" = {vllm_layers_seen}); name it model.mtp_layers.{i}.{leaf}")
        c = _classify(leaf)
        if c is None:
            raise CheckpointError(rd.path(name), name,
                                  f"unknown tensor in MTP layer {i}: misnamed or extra{_hint(leaf)}")
        canon, role, key = c
        k = (i, canon, role, key)
        if k in found:
            raise CheckpointError(rd.path(name), name,
                                  f"duplicated: {found[k]} holds the same MTP tensor")
        found[k] = name
    return found, ignored


def _missing(listing: Path, canon_name: str, ckpt_name: str, extra: str = "") -> CheckpointError:
    return CheckpointError(listing, ckpt_name, f"missing (canonical {canon_name}){extra}")


def _refuse_extras(rd: _Reader, found: dict[tuple, str], cfg: MTPConfig) -> None:
    """Step 3: tensors the config does not call for (a module its layer kind lacks, an expert
    beyond ``n_routed_experts``)."""
    layer_want = layer_shapes(cfg)
    for (i, canon, role, key), name in found.items():
        if i is None:
            continue
        base = canon if not canon.startswith("mlp.experts.") else (
            "mlp.experts.gate_proj" if canon == "mlp.experts.gate_up" else canon)
        if base not in layer_want:
            raise CheckpointError(rd.path(name), name, f"extra: config.json's MTP layer has no {base} "
                                  f"({_layer_kind(cfg)})")
        if key and key[0] == "split" and key[1] >= cfg.n_routed_experts:
            raise CheckpointError(rd.path(name), name, f"expert {key[1]} is out of range: config.json has "
                                  f"n_routed_experts={cfg.n_routed_experts}")


def _load_shared(rd: _Reader, found: dict[tuple, str], want: dict, model_dtype: torch.dtype, listing: Path,
                 weights: dict, source: dict) -> None:
    """Step 4: the embedding and the LM head (shared with the target), stored plain."""
    for canon in ("embed_tokens", "lm_head"):
        name = found.get((None, canon, "weight", ()))
        ckpt = "model.embed_tokens.weight" if canon == "embed_tokens" else "lm_head.weight"
        if name is None:
            raise _missing(listing, canon, ckpt)
        t = _read_plain(rd, name, want[canon], (model_dtype, torch.float32), canon)
        weights[canon], source[canon] = t, [name]


def _load_layer(rd: _Reader, found: dict[tuple, str], i: int, cfg: MTPConfig, hf: dict, plan: Fp8Plan | None,
                model_dtype: torch.dtype, strict_vllm: bool, pfx: str, listing: Path,
                weights: dict, source: dict, fp8_src: dict) -> None:
    """Step 5: MTP layer ``i``'s tensors but the routed experts, each plain or FP8 exactly as the
    plan says vLLM stores it (FP8 dequantized with its block scale)."""
    for leaf, shp in layer_shapes(cfg).items():
        cname = f"layers.{i}.{leaf}"
        if leaf.startswith("mlp.experts."):
            continue
        wname = found.get((i, leaf, "weight", ()))
        sname = found.get((i, leaf, "scale", ()))
        if wname is None:
            raise _missing(listing, cname, pfx + checkpoint_leaf(leaf))
        allowed = (torch.float32, model_dtype) if leaf in FP32_PARAMS else (model_dtype,)
        path, wshape, wdt = rd.meta(wname)
        is_fp8 = _st_dtype(wdt) == "float8_e4m3fn"
        want_fp8 = plan is not None and plan.is_quantized(i, leaf)
        if leaf == "indexer.wk":
            want_fp8 = is_fp8  # vLLM takes either (an FP8 wk is dequantized at load)
        if want_fp8 and not is_fp8:
            raise CheckpointError(path, wname, f"dtype {_st_dtype(wdt)}, but vLLM quantizes this module "
                                  f"to FP8 ({plan.where()})")
        if is_fp8 and not want_fp8:
            why = ("the MTP layers are unquantized (mtp_quant_algo="
                   f"{hf.get('mtp_quant_algo')!r})" if plan is None
                   else _excluded_why(plan, cfg, i, leaf) if leaf in _quantizable()
                   else "vLLM never quantizes this module")
            raise CheckpointError(path, wname, f"stored as float8_e4m3fn, but {why}")
        if not is_fp8:
            if sname is not None:
                raise CheckpointError(rd.path(sname), sname, f"a scale for {wname}, which is "
                                      f"{_st_dtype(wdt)}, not FP8")
            weights[cname] = _read_plain(rd, wname, shp, allowed, cname)
            source[cname] = [wname]
            continue
        suffix = "weight_scale_inv" if plan is None or leaf == "indexer.wk" else plan.scale_suffix
        if sname is None:
            raise _missing(listing, cname, wname.removesuffix(".weight") + "." + suffix,
                           f": {wname} is FP8 and needs its block scale")
        if not sname.endswith("." + suffix):
            raise CheckpointError(rd.path(sname), sname, f"scale named .{sname.rsplit('.', 1)[1]}, but "
                                  f"quantization_config.quant_method {plan.method if plan else None} loads "
                                  f".{suffix} (vLLM would skip it and keep the scale sentinel)")
        block = plan.block_for(*shp) if plan is not None else None
        w, sdt = _read_fp8(rd, wname, sname, shp, block, plan.ue8m0 if plan else False,
                           strict_vllm, leaf == "indexer.wk", cname,
                           plan.scale_shape(*shp) if plan is not None else None)
        weights[cname], source[cname] = w, [wname, sname]
        fp8_src[cname] = Fp8Source(block=block or _wk_block(w.shape, rd, sname), scale_dtype=sdt)


def _excluded_why(plan: Fp8Plan, cfg: MTPConfig, i: int, leaf: str) -> str:
    """Why ``plan`` keeps MTP layer ``i``'s ``leaf`` unquantized: the config key and its matching entry."""
    from .quant import _QUANT_MODULES

    prefix = f"model.layers.{cfg.num_hidden_layers + i}.{_QUANT_MODULES[leaf][0]}"
    return (f"quantization_config.{plan.exclusion_key} excludes it ({plan.excluded_by(prefix)!r} matches "
            f"{prefix})")


def _quantizable() -> set[str]:
    from .quant import _QUANT_MODULES
    return set(_QUANT_MODULES)


def _layer_kind(cfg: MTPConfig) -> str:
    return (f"attention {'sparse' if cfg.attention_sparse else 'dense'}, mlp {'MoE' if cfg.mlp_moe else 'dense'}, "
            f"gated_mla={cfg.gated_mla}, learnable_sink={cfg.learnable_sink}, "
            f"n_shared_experts={cfg.n_shared_experts}")


def _wk_block(shape, rd, sname) -> tuple[int, int]:
    _, sshape, _ = rd.meta(sname)
    if len(sshape) == 1:
        return (1, shape[1])
    return (shape[0] // sshape[0], shape[1] // sshape[1])


def _check_finite(path, name, t: torch.Tensor) -> None:
    bad = ~torch.isfinite(t)
    if bad.any():
        raise CheckpointError(path, name, f"non-finite values ({int(bad.sum())} of {t.numel()})")


def _read_plain(rd: _Reader, name: str, shape, allowed, cname: str) -> torch.Tensor:
    t = _read_stored(rd, name, shape, allowed, cname).to(torch.float64)
    _check_finite(rd.path(name), name, t)
    return t


def _read_stored(rd: _Reader, name: str, shape, allowed, cname: str) -> torch.Tensor:
    """The tensor in its stored dtype, after the shape and dtype checks."""
    path, got_shape, dt = rd.meta(name)
    if tuple(got_shape) != tuple(shape):
        raise CheckpointError(path, name, f"shape {list(got_shape)}, expected {list(shape)} from config.json "
                              f"(canonical {cname})")
    names = [_dt(a) for a in allowed]
    if _st_dtype(dt) not in names:
        raise CheckpointError(path, name, f"dtype {_st_dtype(dt)}, expected {' or '.join(dict.fromkeys(names))}")
    return rd.read(name)[1]


def _read_scale(rd: _Reader, sname: str, want_shape, ue8m0: bool, strict_vllm: bool) -> tuple[torch.Tensor, str]:
    path, sshape, sdt = rd.meta(sname)
    if tuple(sshape) != tuple(want_shape):
        raise CheckpointError(path, sname, f"scale shape {list(sshape)}, expected {list(want_shape)}")
    if strict_vllm and ue8m0 and _st_dtype(sdt) == "uint8":
        if not vllm_reinterprets_uint8(sname.split(".", 3)[3]):
            raise CheckpointError(path, sname, "uint8 UE8M0 bytes in a scale vLLM 0.33 copies numerically into "
                                  "its float8_e8m0fnu/float32 parameter (byte 120 would read as 128.0): "
                                  "store power-of-two float32 or F8_E8M0 here (uint8 is only reinterpreted "
                                  "for routed-expert '.scale' names and the indexer wk)")
    _, s = rd.read(sname)
    try:
        return decode_scale(s, ue8m0), _st_dtype(sdt)
    except ValueError as exc:
        raise CheckpointError(path, sname, str(exc)) from exc


def _read_e4m3(rd: _Reader, wname: str, shape) -> torch.Tensor:
    path, wshape, wdt = rd.meta(wname)
    if tuple(wshape) != tuple(shape):
        raise CheckpointError(path, wname, f"shape {list(wshape)}, expected {list(shape)} from config.json")
    if _st_dtype(wdt) != "float8_e4m3fn":
        raise CheckpointError(path, wname, f"dtype {_st_dtype(wdt)}, expected float8_e4m3fn")
    _, q = rd.read(wname)
    if ((q.view(torch.uint8) & 0x7F) == 0x7F).any():  # e4m3fn NaN: S.1111.111
        raise CheckpointError(path, wname, "non-finite values (e4m3 NaN)")
    return q


def _read_fp8(rd, wname, sname, shape, block, ue8m0, strict_vllm, is_wk, cname, scale_shape=None):
    q = _read_e4m3(rd, wname, shape)
    n, k = shape
    if is_wk:  # vLLM derives the group from the shapes (per-channel, MX or 2-D block)
        path, sshape, _ = rd.meta(sname)
        if len(sshape) == 1:
            sshape = (sshape[0], 1)
        if len(sshape) != 2 or sshape[0] == 0 or sshape[1] == 0 or n % sshape[0] or k % sshape[1]:
            raise CheckpointError(path, sname, f"scale shape {list(sshape)} does not tile the weight {list(shape)}")
        bl = (n // sshape[0], k // sshape[1])
        raw_shape, raw_dt = rd.meta(sname)[1:]
        as_bytes = _st_dtype(raw_dt) in ("uint8", "float8_e8m0fnu")  # vLLM views both as e8m0
        s, sdt = _read_scale(rd, sname, raw_shape, as_bytes, strict_vllm)
        s = s.reshape(sshape)
    else:
        bl = block
        grid = (-(-n // bl[0]), -(-k // bl[1]))
        s, sdt = _read_scale(rd, sname, scale_shape or grid, ue8m0, strict_vllm)
        s = s.reshape(grid)  # ModelOpt's [ob, 1, ib, 1] -> [ob, ib]
    return dequantize_block(q, s, bl), sdt


def _load_experts(rd, found, i, cfg, plan: Fp8Plan | None, strict_vllm, weights, source, fp8_src, pfx, listing):
    e_n, inter, h = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    split = {k: v for k, v in found.items() if k[0] == i and k[3] and k[3][0] == "split"}
    fused = {k: v for k, v in found.items() if k[0] == i and k[3] and k[3][0] == "fused"}
    if split and fused:
        a, b = next(iter(split.values())), next(iter(fused.values()))
        raise CheckpointError(rd.path(b), b, f"duplicated: routed experts of MTP layer {i} come both split "
                              f"({a}) and fused")
    quant = plan is not None and plan.is_quantized(i, "mlp.experts.gate_proj")
    ue8m0 = plan.ue8m0 if plan else False
    ct = plan is not None and plan.method == CT_METHOD
    if ct and fused:
        name = next(iter(fused.values()))
        raise CheckpointError(rd.path(name), name, "fused routed experts in a compressed-tensors checkpoint: not "
                              "modelled (compressed-tensors names expert weights and scales per expert: "
                              "mlp.experts.<e>.<proj>.weight / .weight_scale)")
    expert_suffix = ".weight_scale" if ct else ".weight_scale_inv"
    shape_of = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}

    def check_dtype(name):
        path, _, dt = rd.meta(name)
        is_fp8 = _st_dtype(dt) == "float8_e4m3fn"
        if quant and not is_fp8:
            raise CheckpointError(path, name, f"dtype {_st_dtype(dt)}, but vLLM quantizes the routed experts "
                                  f"to FP8 ({plan.where()})")
        if is_fp8 and not quant:
            why = ("mtp_quant_algo / modules_to_not_convert" if plan is None
                   else _excluded_why(plan, cfg, i, "mlp.experts.gate_proj"))
            raise CheckpointError(path, name, "stored as float8_e4m3fn, but the MTP routed experts are "
                                  f"unquantized here ({why})")

    def scale_of(weight_key_canon, key, wname):
        s = found.get((i, weight_key_canon, "scale", key))
        if quant and s is None:
            raise CheckpointError(listing, (wname + "_scale_inv") if key == ("fused",)
                                  else wname.removesuffix(".weight") + expert_suffix,
                                  f"missing: {wname} is FP8 and needs its block scale")
        if not quant and s is not None:
            raise CheckpointError(rd.path(s), s, "a scale for unquantized routed experts")
        if s is not None and key != ("fused",) and ct != s.endswith(".weight_scale"):
            raise CheckpointError(rd.path(s), s, f"scale named .{s.rsplit('.', 1)[1]}, but quantization_config."
                                  f"quant_method {plan.method} loads expert scales named {expert_suffix} "
                                  "(vLLM would skip it and keep the scale sentinel)")
        return s

    if fused or not split:
        gu = found.get((i, "mlp.experts.gate_up", "weight", ("fused",)))
        dn = found.get((i, "mlp.experts.down_proj", "weight", ("fused",)))
        if not fused:
            raise CheckpointError(listing, f"{pfx}mlp.experts.0.gate_proj.weight",
                                  f"missing: no routed-expert tensors for MTP layer {i} (split or fused)")
        for canon_part, wname, shp in (("mlp.experts.gate_up", gu, (e_n, 2 * inter, h)),
                                       ("mlp.experts.down_proj", dn, (e_n, h, inter))):
            ckpt = f"{pfx}mlp.experts.{'gate_up_proj' if canon_part.endswith('gate_up') else 'down_proj'}"
            if wname is None:
                raise CheckpointError(listing, ckpt, "missing (the other fused expert tensor is present)")
            check_dtype(wname)
            sname = scale_of(canon_part, ("fused",), wname)
            is_gu = canon_part.endswith("gate_up")
            names = ("gate_proj", "up_proj") if is_gu else ("down_proj",)
            rows = shp[1] // len(names)
            if quant:
                q = _read_e4m3(rd, wname, shp)
                bn, bk = plan.block
                if is_gu and inter % bn:
                    raise CheckpointError(rd.path(wname), wname, f"moe_intermediate_size {inter} is not a "
                                          f"multiple of the block {bn}: the fused gate/up scales cannot be split")
                s, sdt = _read_scale(rd, sname, (e_n, -(-shp[1] // bn), -(-shp[2] // bk)), ue8m0, strict_vllm)
                srows = s.shape[1] // len(names)
                srcs = [wname, sname]
            else:
                raw = _read_stored(rd, wname, shp, (_model_dtype(cfg, rd),), f"layers.{i}.{canon_part}")
                srcs, sdt = [wname], None
            for j, proj in enumerate(names):
                cname = f"layers.{i}.mlp.experts.{proj}"
                t = torch.empty((e_n, rows, shp[2]), dtype=torch.float64)
                for e in range(e_n):  # one expert at a time: no full-size float64 temporaries
                    if quant:
                        t[e] = dequantize_block(q[e, j * rows:(j + 1) * rows], s[e, j * srows:(j + 1) * srows],
                                                plan.block)
                    else:
                        t[e] = raw[e, j * rows:(j + 1) * rows]
                if not quant:
                    _check_finite(rd.path(wname), wname, t)
                weights[cname] = t
                source[cname] = list(srcs)
                if quant:
                    fp8_src[cname] = Fp8Source(block=plan.block, scale_dtype=sdt)
        return

    for proj in _EXPERT_PROJ:
        cname = f"layers.{i}.mlp.experts.{proj}"
        canon = f"mlp.experts.{proj}"
        ts = torch.empty((e_n, *shape_of[proj]), dtype=torch.float64)
        srcs, sdt = [], None
        for e in range(e_n):
            wname = found.get((i, canon, "weight", ("split", e)))
            if wname is None:
                raise CheckpointError(listing, f"{pfx}mlp.experts.{e}.{proj}.weight",
                                      f"missing (canonical {cname}[{e}]; n_routed_experts={e_n})")
            check_dtype(wname)
            sname = scale_of(canon, ("split", e), wname)
            if quant:
                q = _read_e4m3(rd, wname, shape_of[proj])
                n, k = shape_of[proj]
                bl = plan.block_for(n, k)
                s, sdt = _read_scale(rd, sname, (-(-n // bl[0]), -(-k // bl[1])), ue8m0, strict_vllm)
                ts[e] = dequantize_block(q, s, bl)
                srcs += [wname, sname]
            else:
                ts[e] = _read_plain(rd, wname, shape_of[proj], (_model_dtype(cfg, rd),), f"{cname}[{e}]")
                srcs.append(wname)
        weights[cname] = ts
        source[cname] = srcs
        if quant:
            fp8_src[cname] = Fp8Source(block=plan.block_for(*shape_of[proj]), scale_dtype=sdt)


def _model_dtype(cfg, rd) -> torch.dtype:
    return rd.model_dtype


def cut_real_case(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, vocab_subset: int, *,
                  force: bool = False) -> Path:
    """A small checkpoint from a real one: its MTP tensors as stored (FP8 stays FP8), the first
    ``vocab_subset`` rows of the embedding and LM head, and config.json with that vocab_size.

    The source is validated with ``load_checkpoint`` first; the result loads with it too.
    """
    from .synth import write_tensors

    loaded = load_checkpoint(ckpt_dir)
    if not 0 < vocab_subset <= loaded.cfg.vocab_size:
        raise ValueError(f"vocab_subset must be in 1..{loaded.cfg.vocab_size}, got {vocab_subset}")
    tensors = loaded.stored_tensors()
    for n in SHARED:
        tensors[n] = tensors[n][:vocab_subset].clone()
    hf = dict(loaded.hf_config)
    hf["vocab_size"] = vocab_subset
    return write_tensors(out_dir, hf, tensors, shards=1, index=True, force=force)
