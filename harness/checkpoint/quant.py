"""Which MTP tensors vLLM 0.33 holds in block FP8, and how their scales are stored.

The rules are read off vLLM 0.33.0 (``models/hy_v4/nvidia``), restated here:

* ``mtp_quant_algo`` picks the MTP layers' quantization independently of the
  backbone: ``"FP8"`` builds an ``Fp8Config`` from ``quantization_config``
  (``weight_block_size``, ``modules_to_not_convert`` / ``ignored_layers``,
  ``scale_fmt: ue8m0``); ``"BF16"`` / ``"FP16"`` leave them unquantized;
  missing or ``"NONE"`` inherits the backbone's config (the same
  ``quantization_config`` for a HY V4 ``config.json``).
* Every ``LinearBase`` built with the quant config is FP8 unless excluded:
  ``fused_qkv_a_proj`` (= ``q_a_proj`` + ``kv_a_proj_with_mqa``), ``q_b_proj``,
  ``kv_b_proj``, ``o_proj``, ``linear_gate``, the indexer's ``wq_b``, the shared
  experts' ``gate_up_proj`` / ``down_proj``, a dense MLP's ``gate_up_proj`` /
  ``down_proj``; the routed experts are FP8 too (``Fp8MoEMethod``).
* Never quantized: ``eh_proj`` (a plain ``nn.Linear``), the router
  ``mlp.gate`` (``GateLinear`` built without a quant config, fp32), the
  indexer's fused ``wk_weights_proj`` (no quant config; an FP8 ``wk`` with its
  ``weight_scale_inv`` is dequantized to bf16 while loading), norms, the sink,
  the embedding and the LM head.
* Exclusions compare exact module prefixes; checkpoint-named MTP prefixes
  (``model.mtp_layers.<i>.``) are translated to the draft's
  ``model.layers.<N+i>.``. A fused module is skipped when its fused name is
  listed or all its shards are; some-but-not-all shards is an error. Modules
  with "experts" in the prefix are skipped when the prefix is a substring of a
  listed name that contains "experts".
* Scales: linear ``<module>.weight_scale_inv``; with ``scale_fmt: ue8m0`` the
  linear scale parameter is ``float8_e8m0fnu`` and is filled by a *numeric*
  copy, so raw uint8 exponent bytes there would be misread (byte 120 -> 128.0).
  Routed-expert scale names ending in ``.scale`` are renamed to
  ``.weight_scale_inv`` and, under ue8m0, uint8 bytes are reinterpreted as
  e8m0; the indexer ``wk`` scale is reinterpreted when uint8/e8m0. The expert
  scale parameters are float32.
"""

from __future__ import annotations

import dataclasses

import torch

from reference.config import MTPConfig
from reference.fp8 import UE8M0_MAX_BYTE, quantize_block, to_e4m3, ue8m0_decode, ue8m0_encode
from reference.weights import layer_shapes

DEFAULT_BLOCK = (128, 128)
from .options import QUANTS


def quant_of_config(hf: dict) -> str:
    """Which of ``QUANTS`` an HF config's MTP layers are stored in (the inverse of ``quantization_config``)."""
    if str(hf.get("mtp_quant_algo") or "").upper() != "FP8":
        return "bf16"
    return "fp8-ue8m0" if (hf.get("quantization_config") or {}).get("scale_fmt") == "ue8m0" else "fp8"

# canonical leaf -> (vLLM module relative to the layer prefix, its checkpoint shards)
_QUANT_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "attn.q_a_proj": ("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    "attn.kv_a_proj_with_mqa": ("self_attn.fused_qkv_a_proj", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
    "attn.q_b_proj": ("self_attn.q_b_proj", ()),
    "attn.kv_b_proj": ("self_attn.kv_b_proj", ()),
    "attn.o_proj": ("self_attn.o_proj", ()),
    "attn.linear_gate": ("self_attn.linear_gate", ()),
    "indexer.wq_b": ("self_attn.indexer.wq_b", ()),
    "mlp.shared_experts.gate_proj": ("mlp.shared_experts.gate_up_proj",
                                     ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
    "mlp.shared_experts.up_proj": ("mlp.shared_experts.gate_up_proj",
                                   ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")),
    "mlp.shared_experts.down_proj": ("mlp.shared_experts.down_proj", ()),
    "mlp.gate_proj": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.up_proj": ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
    "mlp.down_proj": ("mlp.down_proj", ()),
    "mlp.experts.gate_proj": ("mlp.experts", ()),
    "mlp.experts.up_proj": ("mlp.experts", ()),
    "mlp.experts.down_proj": ("mlp.experts", ()),
}

# Modules the synthetic FP8 checkpoints keep in bf16 and list in
# ``modules_to_not_convert`` (only linear_gate needs it; the rest document
# modules vLLM never quantizes).
KEPT_BF16 = ("self_attn.linear_gate", "eh_proj", "mlp.gate", "self_attn.indexer.weights_proj")


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """What vLLM's MTP FP8 path expects: per MTP layer, the canonical leaves held in FP8."""

    block: tuple[int, int]
    ue8m0: bool
    quantized: dict[int, frozenset[str]]
    algo: str  # the mtp_quant_algo that led here, for messages

    def is_quantized(self, layer: int, leaf: str) -> bool:
        return leaf in self.quantized.get(layer, frozenset())


def _skipped(prefix: str, shards: tuple[str, ...], patterns: list[str]) -> bool:
    """vLLM's exact-mode ``is_layer_skipped`` semantics (restated, see module doc)."""
    if shards:
        if prefix in patterns:
            return True
        base = prefix.rsplit(".", 1)[0]
        flags = {f"{base}.{s.rsplit('.', 1)[1]}" in patterns for s in shards}
        if len(flags) > 1:
            raise ValueError(f"some but not all shards of {prefix} are in modules_to_not_convert "
                             f"(vLLM refuses fused layers of mixed precision)")
        return flags.pop()
    if "experts" in prefix:
        return any(prefix in p for p in patterns if "experts" in p)
    return prefix in patterns


def mtp_fp8_plan(hf: dict, cfg: MTPConfig) -> Fp8Plan | None:
    """The FP8 expectations for ``hf``'s MTP layers, or None when they are unquantized.

    Raises ValueError (with the reason) for quantization vLLM would not build
    or the harness does not model.
    """
    algo = hf.get("mtp_quant_algo")
    qc = hf.get("quantization_config") or None
    up = algo.upper() if isinstance(algo, str) else None
    if algo is not None and not isinstance(algo, str):
        raise ValueError(f"mtp_quant_algo must be a string, got {algo!r}")
    if up in ("BF16", "FP16"):
        return None
    if up not in (None, "NONE", "FP8"):
        raise ValueError(f"mtp_quant_algo {algo!r} is not one vLLM 0.33 knows (FP8, BF16, FP16, NONE); "
                         "vLLM would warn and fall back to the backbone's quant config")
    if up != "FP8" and qc is None:
        return None
    qc = qc or {}
    if up != "FP8" and qc.get("quant_method") != "fp8":
        raise ValueError(f"the MTP layers inherit quantization_config quant_method "
                         f"{qc.get('quant_method')!r}, which the harness does not model")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("FP8 without weight_block_size (per-tensor FP8) is not modelled; "
                         "HY V4 checkpoints use 128x128 blocks")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"weight_block_size must be two positive ints, got {block!r}")
    patterns = list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or [])
    n = cfg.num_hidden_layers
    # vLLM widens the list with the draft-prefixed copies of model.mtp_layers.<i>. entries
    for i in range(cfg.num_mtp_layers):
        src = f"model.mtp_layers.{i}."
        patterns += [f"model.layers.{n + i}." + p[len(src):] for p in patterns if p.startswith(src)]
    quantized: dict[int, frozenset[str]] = {}
    for i in range(cfg.num_mtp_layers):
        prefix = f"model.layers.{n + i}."
        leaves = set()
        for leaf in layer_shapes(cfg):
            if leaf not in _QUANT_MODULES:
                continue
            module, shards = _QUANT_MODULES[leaf]
            if not _skipped(prefix + module, tuple(prefix + s for s in shards), patterns):
                leaves.add(leaf)
        quantized[i] = frozenset(leaves)
    return Fp8Plan(block=(block[0], block[1]), ue8m0=qc.get("scale_fmt") == "ue8m0",
                   quantized=quantized, algo=str(algo))


def modules_to_not_convert(cfg: MTPConfig, naming: str, indexer_wk_bf16: bool) -> list[str]:
    """Checkpoint-named MTP modules a synthetic FP8 checkpoint keeps in bf16."""
    from .names import layer_prefix

    out = []
    layer = layer_shapes(cfg)
    for i in range(cfg.num_mtp_layers):
        p = layer_prefix(cfg, i, naming)
        for m in KEPT_BF16:
            if m == "self_attn.linear_gate" and "attn.linear_gate" not in layer:
                continue
            if m == "mlp.gate" and "mlp.gate" not in layer:
                continue
            if m.startswith("self_attn.indexer.") and "indexer.wk" not in layer:
                continue
            out.append(p + m)
        if indexer_wk_bf16 and "indexer.wk" in layer:
            out.append(p + "self_attn.indexer.wk")
    return out


def quantization_config(cfg: MTPConfig, naming: str, quant: str, indexer_wk_fp8: bool) -> dict | None:
    """``config.json``'s quantization_config for a synthetic checkpoint (None for bf16)."""
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    if quant == "bf16":
        return None
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": list(DEFAULT_BLOCK),
          "modules_to_not_convert": modules_to_not_convert(cfg, naming, not indexer_wk_fp8)}
    if quant == "fp8-ue8m0":
        qc["scale_fmt"] = "ue8m0"
    return qc


def quantize_weight(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                    ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 (q e4m3, scale float64) with every scale exactly a float32 value.

    ``reference.fp8.quantize_block``'s scale amax/448 is rounded to float32 (as
    the checkpoint stores it) and q recomputed against the rounded scale, so
    the stored pair dequantizes to exactly q * s. UE8M0 scales are powers of
    two already.
    """
    q, s = quantize_block(w, block, ue8m0=ue8m0)
    if ue8m0:
        return q, s
    s = s.to(torch.float32).to(torch.float64)
    bn, bk = block
    *_, n, k = w.shape
    full = s.repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    return to_e4m3(w.to(torch.float64) / full), s


def encode_scale(scale: torch.Tensor, ue8m0: bool, storage: str) -> torch.Tensor:
    """float64 scales -> the stored tensor: float32, or for UE8M0 uint8 bytes / e8m0 / float32."""
    if not ue8m0 or storage == "float32":
        return scale.to(torch.float32)
    if storage == "uint8":
        return ue8m0_encode(scale)
    if storage == "e8m0":
        return ue8m0_encode(scale).view(torch.float8_e8m0fnu)
    raise ValueError(f"scale storage must be float32, uint8 or e8m0, got {storage!r}")


def decode_scale(t: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    """A stored scale -> float64, raising ValueError naming the problem.

    float32: finite and > 0 (and a power of two under ue8m0); uint8 (ue8m0
    only): exponent bytes 0..254; float8_e8m0fnu: its bytes, 0..254.
    """
    if t.dtype == torch.uint8 or t.dtype == torch.float8_e8m0fnu:
        b = t.view(torch.uint8) if t.dtype == torch.float8_e8m0fnu else t
        if t.dtype == torch.uint8 and not ue8m0:
            raise ValueError("uint8 scale bytes but quantization_config has no scale_fmt ue8m0 "
                             "(vLLM would copy the byte values into a float32 scale)")
        if b.numel() and int(b.max()) > UE8M0_MAX_BYTE:
            bad = int((b > UE8M0_MAX_BYTE).sum())
            raise ValueError(f"UE8M0 byte 255 (NaN) in {bad} scale entr{'y' if bad == 1 else 'ies'}")
        return ue8m0_decode(b)
    if t.dtype != torch.float32:
        raise ValueError(f"scale dtype {_dt(t.dtype)}, expected float32"
                         + (", uint8 or float8_e8m0fnu" if ue8m0 else ""))
    s = t.to(torch.float64)
    if not torch.isfinite(s).all():
        raise ValueError(f"non-finite scale ({int((~torch.isfinite(s)).sum())} entries)")
    if (s == 0).any():
        raise ValueError(f"zero scale ({int((s == 0).sum())} entries)")
    if (s < 0).any():
        raise ValueError(f"negative scale ({int((s < 0).sum())} entries)")
    if ue8m0:
        e = torch.log2(s)
        if not torch.all(e == torch.round(e)):
            raise ValueError("scale_fmt ue8m0 but a float32 scale is not a power of two "
                             "(vLLM would round it into its float8_e8m0fnu parameter)")
    return s


def vllm_reinterprets_uint8(leaf: str) -> bool:
    """Whether vLLM views uint8 bytes of this checkpoint scale leaf as e8m0 (ue8m0 config).

    True for routed-expert scales named ``....scale`` and for the indexer wk
    scale; every other scale is copied numerically.
    """
    return (leaf.startswith("mlp.experts.") and leaf.endswith(".scale")) or \
        leaf.startswith("self_attn.indexer.wk.")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
