"""Synthetic HY V4 MTP checkpoints: ``python -m harness synth OUT_DIR ...``.

One seed gives the same canonical weights (``reference.weights.random_weights``)
in every layout: naming ``mtp_layers`` / ``layers``, experts ``split`` /
``fused``, and quant ``bf16`` / ``fp8`` / ``fp8-ue8m0`` / ``modelopt-fp8-pb``. The FP8
variants hold in block FP8 exactly the modules vLLM 0.33's MTP quantization
config quantizes (see ``harness.checkpoint.quant``: ``Fp8Config`` +
``modules_to_not_convert``, or ModelOpt ``FP8_PB_WO`` + ``exclude_modules`` with
exact names and wildcards, 4-D ``weight_scale``); the compressed-tensors variants
(``compressed-tensors-fp8`` channel, ``-block``) hold in FP8 what their ``ignore`` list
does not name (``weight_scale`` per output row or per 128x128 block, split experts
only); the rest stay bf16, with the
fp32 exceptions vLLM keeps (router weight, expert bias, sink, indexer k_norm).

The checkpoint holds the MTP layers, ``model.embed_tokens.weight`` and
``lm_head.weight`` only (no backbone). It is written into ``OUT_DIR.tmp-<pid>``
and renamed onto OUT_DIR (``harness.atomic.atomic_write_dir``), so a reader never sees half a
checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from reference.config import ConfigError, MTPConfig
from reference.weights import check_weights, is_fp32_param, random_weights

from harness.atomic import NotRegularFile, atomic_write_dir, write_errors, write_failure

from .errors import CheckpointError
from .names import canonical_leaf, parse_layer_name, to_checkpoint
from .options import CT_QUANTS, EXPERT_LAYOUTS, EXPERT_SCALE_SUFFIXES, NAMINGS, QUANTS, SCALE_DTYPES
from .quant import DEFAULT_BLOCK, encode_scale, quantize_weight, vllm_reinterprets_uint8
from .quant_config import quantization_config


def synth_config(preset_name: str = "tiny", *, mtp_layers: int = 1, index_share: bool = False,
                 dense_mlp: bool = False, headwise_gate: bool = False, no_sink: bool = False,
                 **overrides) -> dict:
    """A preset's HF config with the MTP switches applied (quant fields are set at write)."""
    from harness.presets import preset

    hf = preset(preset_name, **overrides)
    hf["num_nextn_predict_layers"] = int(mtp_layers)
    if index_share:
        hf["index_share_for_mtp_iteration"] = True
    if dense_mlp:
        hf["mlp_layer_types"] = ["dense"] * hf["num_hidden_layers"]
    if headwise_gate:
        hf["gating_type"] = "headwise"
    if no_sink:
        hf["learnable_sink"] = False
    return hf


def _check_fp8_dims(cfg: MTPConfig) -> None:
    """The divisibility vLLM's Fp8LinearMethod / Fp8MoEMethod check at TP=1."""
    bn = DEFAULT_BLOCK[0]
    dims = {"q_lora_rank (first shard of fused_qkv_a_proj)": cfg.q_lora_rank}
    if cfg.mlp_moe:
        dims["moe_intermediate_size (routed experts)"] = cfg.moe_intermediate_size
        if cfg.n_shared_experts:
            dims["moe_intermediate_size*n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    else:
        dims["intermediate_size (first shard of gate_up_proj)"] = cfg.intermediate_size
    bad = [f"{k}={v}" for k, v in dims.items() if v % bn]
    if bad:
        raise ConfigError(f"FP8 {bn}x{bn} blocks need these dims to be multiples of {bn}: {', '.join(bad)}")


def _scale_name(name: str, leaf: str, expert_scale_suffix: str, linear_suffix: str = "weight_scale_inv") -> str:
    """Checkpoint name of the block scale of weight ``name`` (``leaf`` is its per-layer leaf)."""
    if leaf in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # fused
        return name + ("_scale_inv" if expert_scale_suffix == "weight_scale_inv" else ".scale")
    base = name.removesuffix(".weight")
    if leaf.startswith("mlp.experts."):
        return f"{base}.{expert_scale_suffix}"
    return f"{base}.{linear_suffix}"


def checkpoint_tensors(hf: dict, weights: dict[str, torch.Tensor], *, naming: str = "mtp_layers",
                       experts: str = "split", quant: str = "bf16",
                       expert_scale_suffix: str = "weight_scale_inv", scale_dtype: str = "auto",
                       indexer_wk_fp8: bool = True, bf16_layers=(),
                       ct_ignore_style: str = "regex") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, stored tensors) for canonical float64 ``weights``; nothing is written.

    modelopt-fp8-pb and the compressed-tensors quants keep the indexer wk in bf16
    (``indexer_wk_fp8`` is ignored) and write no ``mtp_quant_algo`` (the MTP layers inherit the
    checkpoint's config); ``ct_ignore_style``: ``quant_config.ct_ignore``'s style."""
    if naming not in NAMINGS:
        raise ValueError(f"naming must be one of {NAMINGS}, got {naming!r}")
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, got {experts!r}")
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if expert_scale_suffix not in EXPERT_SCALE_SUFFIXES:
        raise ValueError(f"expert_scale_suffix must be one of {EXPERT_SCALE_SUFFIXES}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {SCALE_DTYPES}, got {scale_dtype!r}")
    hf = copy.deepcopy(hf)
    cfg = MTPConfig.from_hf_dict(hf)
    check_weights(cfg, weights)
    fp8 = quant != "bf16"
    if fp8:
        _check_fp8_dims(cfg)
    modelopt = quant == "modelopt-fp8-pb"
    ct = quant in CT_QUANTS
    if ct and experts != "split":
        raise ValueError(f"--quant {quant} --experts {experts}: compressed-tensors names expert scales per "
                         "expert (mlp.experts.<e>.<proj>.weight_scale); fused experts are not modelled")
    if modelopt or ct:
        indexer_wk_fp8 = False
        hf.pop("mtp_quant_algo", None)
    else:
        hf["mtp_quant_algo"] = "FP8" if fp8 else "BF16"
    qc = quantization_config(cfg, naming, quant, indexer_wk_fp8, bf16_layers, ct_ignore_style)
    hf.pop("quantization_config", None)
    if qc is not None:
        hf["quantization_config"] = qc
    plan = None
    if fp8:
        from .quant import mtp_fp8_plan
        plan = mtp_fp8_plan(hf, cfg)
    ue8m0 = quant == "fp8-ue8m0"

    def store_scale(sname: str, s: torch.Tensor) -> torch.Tensor:
        storage = scale_dtype
        if storage == "auto":
            sleaf = parse_layer_name(sname, cfg.num_hidden_layers)[2]
            storage = "uint8" if vllm_reinterprets_uint8(sleaf) else "float32"
        return encode_scale(s, ue8m0, storage)

    out: dict[str, torch.Tensor] = {}
    # routed experts are written expert by expert (no [E, 2I, H] float64 temporaries: real-dims fits)
    dense = {k: v for k, v in weights.items() if ".mlp.experts." not in k}
    for name, value in to_checkpoint(cfg, dense, naming, experts).items():
        parsed = parse_layer_name(name, cfg.num_hidden_layers)
        if parsed is None:  # embed_tokens, lm_head
            out[name] = value.to(torch.bfloat16)
            continue
        layer, _, leaf = parsed
        canon = canonical_leaf(leaf)
        assert canon is not None, name
        q = plan is not None and (plan.is_quantized(layer, canon)
                                  or (canon == "indexer.wk" and indexer_wk_fp8))
        if not q:
            dtype = torch.float32 if is_fp32_param(f"layers.{layer}.{canon}") else torch.bfloat16
            out[name] = value.to(dtype)
            continue
        w, s = quantize_weight(value, plan.block_for(*value.shape) if plan else DEFAULT_BLOCK, ue8m0)
        sname = _scale_name(name, leaf, expert_scale_suffix, plan.scale_suffix if plan else "weight_scale_inv")
        if modelopt:  # ModelOpt's block scale layout [out_blocks, 1, in_blocks, 1]
            s = s.reshape(s.shape[0], 1, s.shape[1], 1)
        out[name] = w
        out[sname] = store_scale(sname, s)
    for layer in range(cfg.num_mtp_layers):
        if f"layers.{layer}.mlp.experts.gate_proj" in weights:
            out.update(_expert_tensors(cfg, weights, layer, naming, experts,
                                       plan is not None and plan.is_quantized(layer, "mlp.experts.gate_proj"),
                                       ue8m0, "weight_scale" if ct else expert_scale_suffix, store_scale,
                                       plan.block_for if plan is not None else None))
    return hf, out


def _expert_tensors(cfg, weights, layer, naming, experts, quantized, ue8m0, suffix, store_scale, block_for=None):
    """One MTP layer's routed-expert checkpoint tensors, built one expert at a time (``block_for(n, k)``:
    the tile one scale covers, default 128x128 blocks)."""
    from .names import layer_prefix

    prefix = layer_prefix(cfg, layer, naming)
    src = {p: weights[f"layers.{layer}.mlp.experts.{p}"] for p in ("gate_proj", "up_proj", "down_proj")}
    n_exp = src["gate_proj"].shape[0]
    out: dict[str, torch.Tensor] = {}

    def one(w: torch.Tensor):
        if not quantized:
            return w.to(torch.bfloat16), None
        return quantize_weight(w, block_for(*w.shape) if block_for else DEFAULT_BLOCK, ue8m0)

    if experts == "split":
        for e in range(n_exp):
            for p, v in src.items():
                name = f"{prefix}mlp.experts.{e}.{p}.weight"
                w, s = one(v[e])
                out[name] = w
                if s is not None:
                    sname = _scale_name(name, f"mlp.experts.{e}.{p}.weight", suffix)
                    out[sname] = store_scale(sname, s)
        return out
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        ws, ss = [], []
        for e in range(n_exp):
            pieces = [one(src[p][e]) for p in parts]
            ws.append(torch.cat([w for w, _ in pieces], dim=-2))
            if quantized:
                ss.append(torch.cat([s for _, s in pieces], dim=-2))
        name = f"{prefix}mlp.experts.{fused}"
        out[name] = torch.stack(ws)
        if quantized:
            sname = _scale_name(name, f"mlp.experts.{fused}", suffix)
            out[sname] = store_scale(sname, torch.stack(ss))
    return out


def _shard_names(n: int) -> list[str]:
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def write_tensors(out_dir: str | os.PathLike, hf: dict, tensors: dict[str, torch.Tensor], *,
                  shards: int = 1, index: bool = True, force: bool = False) -> Path:
    """Write config.json + safetensors shards (+ index) atomically into ``out_dir``."""
    out = Path(out_dir)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if not index and shards != 1:
        raise ValueError("a checkpoint without an index has exactly one shard")
    if index and shards > len(tensors):  # every shard holds at least one tensor: no empty shard files
        raise ValueError(f"--shards {shards}: more shards than the {len(tensors)} tensors to write")

    def fill(tmp: Path) -> None:
        names = sorted(tensors)
        files = _shard_names(shards) if index else ["model.safetensors"]
        buckets: list[dict[str, torch.Tensor]] = [{} for _ in files]
        # contiguous runs of sorted names, so a layer's tensors sit together; the
        # runs differ by at most one tensor, so no shard is empty
        weight_map = {}
        for j, name in enumerate(names):
            k = j * len(files) // len(names)
            buckets[k][name] = tensors[name].contiguous()
            weight_map[name] = files[k]
        total = 0
        for fname, bucket in zip(files, buckets):
            save_file(bucket, str(tmp / fname), metadata={"format": "pt"})
            total += sum(t.numel() * t.element_size() for t in bucket.values())
        if index:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    return atomic_write_dir(out, fill, replace=force)


def write_synthetic(out_dir: str | os.PathLike, hf_config: dict, weights: dict[str, torch.Tensor], *,
                    naming: str = "mtp_layers", experts: str = "split", quant: str = "bf16",
                    shards: int = 1, expert_scale_suffix: str = "weight_scale_inv",
                    scale_dtype: str = "auto", indexer_wk_fp8: bool = True, index: bool = True,
                    force: bool = False, bf16_layers=(), ct_ignore_style: str = "regex") -> Path:
    """Write canonical float64 ``weights`` as a HY V4 MTP checkpoint; returns its directory.

    ``hf_config`` is the model's config.json dict (``num_nextn_predict_layers``
    and the MTP switches already set); ``mtp_quant_algo`` and
    ``quantization_config`` are set here from ``quant``. ``expert_scale_suffix``
    "scale" names expert scales ``....scale`` (vLLM renames them), and
    ``scale_dtype`` picks how UE8M0 scales are stored: "auto" = uint8 bytes where
    vLLM reinterprets bytes (expert ``.scale`` names, indexer wk) and
    power-of-two float32 elsewhere; "uint8", "float32", "e8m0" everywhere
    ("uint8" on linear scales is a checkpoint vLLM misreads: the loader refuses it).
    """
    hf, tensors = checkpoint_tensors(hf_config, weights, naming=naming, experts=experts, quant=quant,
                                     expert_scale_suffix=expert_scale_suffix,
                                     scale_dtype=scale_dtype, indexer_wk_fp8=indexer_wk_fp8,
                                     bf16_layers=bf16_layers, ct_ignore_style=ct_ignore_style)
    return write_tensors(out_dir, hf, tensors, shards=shards, index=index, force=force)


# the canonical weights are drawn in float64 before they are cast for the checkpoint: their
# elements bound what a synthetic checkpoint may hold (16 GiB of float64; real-dims with one MTP
# layer is 1.8 G elements)
MAX_WEIGHT_ELEMENTS = 2 ** 31


def _check_size(cfg: MTPConfig, args) -> None:
    """ValueError (exit 2) naming the flags when the weights would not fit ``MAX_WEIGHT_ELEMENTS``."""
    import math

    from reference.weights import shapes

    n = sum(math.prod(s) for s in shapes(cfg).values())
    if n > MAX_WEIGHT_ELEMENTS:
        raise ValueError(f"--preset {args.preset} --mtp-layers {args.mtp_layers}"
                         + (f" --vocab-size {args.vocab_size}" if args.vocab_size is not None else "")
                         + f": {n} float64 weight elements ({n * 8 / 2 ** 30:.1f} GiB), more than "
                         f"{MAX_WEIGHT_ELEMENTS} (2**31, 16 GiB); use fewer MTP layers or a smaller preset")


def synth_command(args) -> int:
    overrides = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    try:
        hf = synth_config(args.preset, mtp_layers=args.mtp_layers, index_share=args.index_share,
                          dense_mlp=args.dense_mlp, headwise_gate=args.headwise_gate,
                          no_sink=args.no_sink, **overrides)
        cfg = MTPConfig.from_hf_dict(hf)
        _check_size(cfg, args)
        if args.naming == "layers" and cfg.num_mtp_layers > max(cfg.num_nextn_predict_layers - 1, 1):
            print("warning: vLLM 0.33 reads model.layers.<N+i> MTP tensors only for "
                  "i < max(num_nextn_predict_layers - 1, 1); use --naming mtp_layers for "
                  f"{cfg.num_mtp_layers} MTP layers", file=sys.stderr)
        weights = random_weights(cfg, args.seed)
        out = write_synthetic(args.out_dir, hf, weights, naming=args.naming, experts=args.experts,
                              quant=args.quant, shards=args.shards,
                              expert_scale_suffix=args.expert_scale_suffix,
                              scale_dtype=args.scale_dtype, indexer_wk_fp8=not args.bf16_indexer_wk,
                              index=not args.no_index, force=args.force,
                              bf16_layers=tuple(args.bf16_mtp_layer or ()),
                              ct_ignore_style=args.ct_ignore)
    except NotRegularFile as exc:
        raise write_failure(args.out_dir, exc) from exc
    except (FileExistsError, ValueError, ConfigError, CheckpointError) as exc:
        from harness.exitcodes import one_line, printable
        print(printable(f"error: {one_line(exc)}"), file=sys.stderr)
        return 2
    except write_errors() as exc:  # disk full, I/O error: nothing was left behind (write_tensors)
        raise write_failure(args.out_dir, exc) from exc
    from harness.exitcodes import printable

    print(printable(f"wrote {out} (preset {args.preset}, seed {args.seed}, naming {args.naming}, "
                    f"experts {args.experts}, quant {args.quant}, {args.shards} shard(s))"))
    return 0
