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

ModelOpt (``quantization_config.quant_method: modelopt``, vLLM's ``ModelOptFp8Config``):

* Only reached with ``mtp_quant_algo`` missing or ``"NONE"`` (the MTP layers
  inherit the backbone's config); ``mtp_quant_algo: FP8`` builds an
  ``Fp8Config`` from the same dict instead, which never reads ``exclude_modules``.
* The exclusion list is ``ignore`` or else ``exclude_modules`` (a list).
  ``HYV4MTP._remap_mtp_quant_exclusions`` widens it with the draft-named copies
  of every ``model.mtp_layers.<i>.`` entry, keeping a trailing ``*``
  (``model.mtp_layers.0*`` does not start with ``model.mtp_layers.0.`` and is
  not remapped). A module is excluded when ``is_layer_skipped`` (exact, with the
  fused and "experts" rules above) matches, when a listed entry is a substring
  of its prefix, or when an entry matches it as an ``fnmatch`` wildcard.
* ``quant_algo FP8_PB_WO``: every non-excluded ``LinearBase`` holds e4m3
  ``weight`` + float32 ``weight_scale`` shaped ``[ceil(out/128), 1, in/128, 1]``
  (a dequantization multiplier, like ``weight_scale_inv``), activations are
  quantized dynamically per 128-group (no ``input_scale``); ``in`` must be a
  multiple of 128. The shared LM head (prefix ``lm_head``) is a quantizable
  ``ParallelLMHead`` here. The routed experts always get the per-tensor static
  ``ModelOptFp8MoEMethod`` (weight and input scale per expert).

compressed-tensors (``quantization_config.quant_method: compressed-tensors``, vLLM's
``CompressedTensorsConfig``; the same in 0.33.0 and 0.34.0):

* Only reached with ``mtp_quant_algo`` missing or ``"NONE"`` (inherited), like ModelOpt.
* ``config_groups`` map targets (here ``["Linear"]``; the routed experts match through
  ``_add_fused_moe_to_target_scheme_map``) to a scheme; the harness builds FP8 W8A8 with
  ``format: float-quantized``: weights static symmetric, ``strategy: channel`` (float32
  ``weight_scale`` [out, 1], one multiplier per output row) or ``strategy: block`` with
  ``block_structure [128, 128]`` (``weight_scale`` [ceil(out/128), ceil(in/128)]); input
  activations dynamic (per token, or per group of 128 for blocks). Scales are named
  ``weight_scale`` for linears and split experts alike.
* ``ignore`` lists modules kept unquantized, by the names the checkpoint gives them: an entry is
  an exact name or ``re:<regex>`` (``re.match``, anchored at the start only). A fused module is
  ignored when its name matches, else when every shard matches (some-but-not-all is an error);
  routed experts are matched through ``<prefix>.0.{gate,up,down}_proj`` (all three or none).
* ``HYV4MTP._remap_mtp_quant_exclusions`` reads ``ignored_layers`` / ``exclude_modules`` only
  (``_MTP_QUANT_EXCLUSION_ATTRS``), not ``ignore``: vLLM matches the entries against the draft
  prefixes (``model.layers.<N+i>.``) as they are, so a checkpoint-named MTP entry
  (``model.mtp_layers.0.self_attn.linear_gate``) never reaches its module. ``Fp8Plan.excluded_by``
  says what the checkpoint means (an entry matching the module under its checkpoint name or its
  draft name); ``Fp8Plan.vllm_excluded_by`` what vLLM builds. Where they differ the module is
  vLLM's gap (``vllm_gap``), named by the post-load audit.
"""

from __future__ import annotations

import dataclasses
import re
from fnmatch import fnmatch

import torch

from reference.config import MTPConfig
from reference.fp8 import UE8M0_MAX_BYTE, quantize_block, to_e4m3, ue8m0_decode, ue8m0_encode
from reference.weights import layer_shapes

DEFAULT_BLOCK = (128, 128)

CT_METHOD = "compressed-tensors"
CT_FORMAT = "float-quantized"
# what vLLM's MTP remap reads (mtp.py _MTP_QUANT_EXCLUSION_ATTRS): why a compressed-tensors ignore
# entry naming an MTP module by its checkpoint name does not reach the draft
CT_GAP = ("vLLM gap: HYV4MTP._remap_mtp_quant_exclusions reads only ignored_layers / exclude_modules "
          "(_MTP_QUANT_EXCLUSION_ATTRS), not compressed-tensors' ignore, so the checkpoint-named entry "
          "never matches the draft prefix")


def quant_of_config(hf: dict) -> str:
    """Which of ``QUANTS`` an HF config's MTP layers are stored in (the inverse of ``quantization_config``)."""
    qc = hf.get("quantization_config") or {}
    algo = str(hf.get("mtp_quant_algo") or "").upper()
    if isinstance(qc, dict) and str(qc.get("quant_method") or "").lower() == "modelopt" and algo in ("", "NONE"):
        return "modelopt-fp8-pb"
    if isinstance(qc, dict) and str(qc.get("quant_method") or "").lower() == CT_METHOD and algo in ("", "NONE"):
        groups = qc.get("config_groups") or {}
        first = next(iter(groups.values()), {}) if isinstance(groups, dict) else {}
        strategy = ((first or {}).get("weights") or {}).get("strategy") if isinstance(first, dict) else None
        return "compressed-tensors-fp8-block" if strategy == "block" else "compressed-tensors-fp8"
    if algo != "FP8":
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


# HYV4MTP.packed_modules_mapping: fused vLLM module -> its checkpoint shards
PACKED = {"gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
          "wk_weights_proj": ("wk", "weights_proj")}
MODELOPT_ALGO = "FP8_PB_WO"
# ModelOpt FP8 algos vLLM's ModelOptFp8Config takes that the harness does not build, with the reason
MODELOPT_UNMODELLED = {
    "FP8": "per-tensor static W8A8: every linear's activations are quantized with a calibrated "
           "input_scale the synthetic checkpoints have no calibration for",
    "FP8_PER_CHANNEL_PER_TOKEN": "per-channel weight scales with per-token activations: not modelled "
                                 "by the reference's FP8 emulation (block scales only)",
}


@dataclasses.dataclass(frozen=True)
class Fp8Plan:
    """What vLLM's MTP FP8 path expects: per MTP layer, the canonical leaves held in FP8.

    ``method``: quantization_config.quant_method ("fp8": Fp8Config, "modelopt": ModelOptFp8Config);
    ``exclusion_key``: the config key the exclusion list came from; ``patterns``: that list as
    vLLM holds it after the MTP remap; ``scale_suffix``: the linear scale leaf vLLM loads.
    """

    block: tuple[int, int]
    ue8m0: bool
    quantized: dict[int, frozenset[str]]
    algo: str  # the mtp_quant_algo that led here, for messages
    method: str = "fp8"
    exclusion_key: str = "modules_to_not_convert"
    patterns: tuple[str, ...] = ()
    scale_suffix: str = "weight_scale_inv"
    # compressed-tensors: "channel" (one scale per output row) or "block"
    strategy: str = "block"
    # compressed-tensors: (draft prefix, checkpoint prefix) per MTP layer, ("model.layers.<N+i>.",
    # "model.mtp_layers.<i>."): an ignore entry means a module under either name
    aliases: tuple = ()

    def is_quantized(self, layer: int, leaf: str) -> bool:
        return leaf in self.quantized.get(layer, frozenset())

    def where(self) -> str:
        """The config that decided, for messages."""
        if self.method in ("modelopt", CT_METHOD):
            return (f"quantization_config.quant_method {self.method}, not matched by "
                    f"quantization_config.{self.exclusion_key}")
        return f"mtp_quant_algo={self.algo}, not in quantization_config.{self.exclusion_key}"

    def excluded_by(self, prefix: str) -> str | None:
        """The exclusion entry that keeps the vLLM module at quant prefix ``prefix`` unquantized, or None.

        ``prefix`` is the name vLLM builds the module under (``model.layers.<N+i>.self_attn.o_proj``,
        ``lm_head``); a fused module is matched through its shards (``PACKED``).
        """
        proj = prefix.rsplit(".", 1)[-1]
        base = prefix.rsplit(".", 1)[0]
        shards = tuple(f"{base}.{s}" for s in PACKED.get(proj, ()))
        if self.method == CT_METHOD:
            for name in (prefix, *self._alias_names(prefix)):
                hit = match_compressed_tensors(name, list(self.patterns))
                if hit is not None:
                    return hit
            return None
        match = match_modelopt if self.method == "modelopt" else match_fp8config
        return match(prefix, shards, list(self.patterns))

    def vllm_excluded_by(self, prefix: str) -> str | None:
        """The entry vLLM itself matches for the module at quant prefix ``prefix`` (for
        compressed-tensors: the draft prefix as it is, no remap; else ``excluded_by``)."""
        if self.method == CT_METHOD:
            return match_compressed_tensors(prefix, list(self.patterns))
        return self.excluded_by(prefix)

    def vllm_gap(self, prefix: str) -> str | None:
        """Why vLLM builds quantized a module the checkpoint excludes (None where vLLM agrees)."""
        hit = self.excluded_by(prefix)
        if hit is None or self.vllm_excluded_by(prefix) is not None:
            return None
        return f"{CT_GAP} {prefix} ({hit!r})"

    def _alias_names(self, prefix: str) -> tuple[str, ...]:
        return tuple(ckpt + prefix[len(draft):] for draft, ckpt in self.aliases if prefix.startswith(draft))

    def block_for(self, n: int, k: int) -> tuple[int, int]:
        """The (rows, cols) tile one scale covers in an [n, k] weight (channel: one row)."""
        return (1, k) if self.strategy == "channel" else self.block

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        """The stored linear block-scale shape of an [n, k] weight."""
        bn, bk = self.block_for(n, k)
        ob, ib = -(-n // bn), -(-k // bk)
        return (ob, 1, ib, 1) if self.method == "modelopt" else (ob, ib)


def remap_mtp_exclusions(patterns: list[str], num_hidden_layers: int, num_mtp_layers: int) -> list[str]:
    """``patterns`` widened with their draft-named copies (HYV4MTP's ``_remap_mtp_quant_exclusions``)."""
    extra = []
    for i in range(num_mtp_layers):
        src, dst = f"model.mtp_layers.{i}.", f"model.layers.{num_hidden_layers + i}."
        for p in patterns:
            if p.startswith(src):
                extra.append(dst + p[len(src):])
            elif p.rstrip("*").startswith(src):
                stripped = p.rstrip("*")
                extra.append(dst + stripped[len(src):] + p[len(stripped):])
    return list(patterns) + extra


def _exact(prefix: str, shards: tuple[str, ...], patterns: list[str]) -> str | None:
    """vLLM's exact-mode ``is_layer_skipped`` (see module doc): the matching entry or None."""
    if shards:
        if prefix in patterns:
            return prefix
        hits = [s for s in shards if s in patterns]
        if hits and len(hits) != len(shards):
            raise ValueError(f"some but not all shards of {prefix} are excluded ({', '.join(hits)}): "
                             f"vLLM refuses fused layers of mixed precision")
        return hits[0] if hits else None
    if "experts" in prefix:
        return next((p for p in patterns if "experts" in p and prefix in p), None)
    return prefix if prefix in patterns else None


def match_fp8config(prefix: str, shards: tuple[str, ...], patterns: list[str]) -> str | None:
    """Fp8Config's exclusion (``ignored_layers`` / ``modules_to_not_convert``): exact prefixes."""
    return _exact(prefix, shards, patterns)


def match_modelopt(prefix: str, shards: tuple[str, ...], patterns: list[str]) -> str | None:
    """ModelOptFp8Config's ``is_layer_excluded``: exact, then substring, then ``fnmatch`` wildcard."""
    hit = _exact(prefix, shards, patterns)
    if hit is not None:
        return hit
    hit = next((p for p in patterns if p != prefix and p in prefix), None)
    if hit is not None:
        return hit
    return next((p for p in patterns if fnmatch(prefix, p)), None)


def _ct_equal_or_regex(value: str, entry: str) -> bool:
    """compressed-tensors' ``is_equal_or_regex_match``: ``re:<regex>`` is ``re.match`` (anchored at the
    start, not the end), anything else an exact name."""
    if entry.startswith("re:"):
        return re.match(entry[3:], value) is not None
    return entry == value


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def match_compressed_tensors(prefix: str, patterns: list[str]) -> str | None:
    """``CompressedTensorsConfig``'s ignore rule for the module at ``prefix``: the matching entry or None.

    The name itself, else each shard of a fused module (``PACKED``); routed experts (``...mlp.experts``)
    by ``<prefix>.0.<proj>`` for gate/up/down. ValueError when some but not all shards (or expert
    projections) match: vLLM refuses mixed schemes there."""
    if prefix.endswith(".mlp.experts"):
        names = [f"{prefix}.0.{p}" for p in _EXPERT_PROJS]
    else:
        hit = next((p for p in patterns if _ct_equal_or_regex(prefix, p)), None)
        if hit is not None:
            return hit
        proj = prefix.rsplit(".", 1)[-1]
        if proj not in PACKED:
            return None
        base = prefix.rsplit(".", 1)[0]
        names = [f"{base}.{s}" for s in PACKED[proj]]
    hits = [next((p for p in patterns if _ct_equal_or_regex(n, p)), None) for n in names]
    matched = [h for h in hits if h is not None]
    if matched and len(matched) != len(hits):
        parts = ", ".join(f"{n}: {h!r}" for n, h in zip(names, hits))
        raise ValueError(f"some but not all parts of {prefix} are ignored ({parts}): vLLM refuses a module "
                         f"whose parts have different schemes")
    return matched[0] if matched else None


def _quantized_leaves(cfg: MTPConfig, plan: Fp8Plan) -> dict[int, frozenset[str]]:
    n = cfg.num_hidden_layers
    quantized: dict[int, frozenset[str]] = {}
    for i in range(cfg.num_mtp_layers):
        prefix = f"model.layers.{n + i}."
        leaves = set()
        for leaf in layer_shapes(cfg):
            try:
                if leaf in _QUANT_MODULES and plan.excluded_by(prefix + _QUANT_MODULES[leaf][0]) is None:
                    leaves.add(leaf)
            except ValueError as exc:  # mixed shards of a fused module
                raise ValueError(f"quantization_config.{plan.exclusion_key}: {exc}") from exc
        quantized[i] = frozenset(leaves)
    return quantized


def mtp_fp8_plan(hf: dict, cfg: MTPConfig) -> Fp8Plan | None:
    """The FP8 expectations for ``hf``'s MTP layers, or None when they are unquantized.

    Raises ValueError (with the reason, naming the config key) for quantization vLLM would not
    build or the harness does not model.
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
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config must be an object, got {qc!r}")
    if str(qc.get("quant_method") or "").lower() == "modelopt":
        if up == "FP8":
            raise ValueError("mtp_quant_algo FP8 with quantization_config.quant_method modelopt: vLLM then "
                             "builds the MTP layers an Fp8Config from quantization_config, which never reads "
                             "exclude_modules; drop mtp_quant_algo (or set NONE) to inherit the ModelOpt config")
        return _modelopt_plan(qc, cfg, str(algo))
    if str(qc.get("quant_method") or "").lower() == CT_METHOD:
        if up == "FP8":
            raise ValueError("mtp_quant_algo FP8 with quantization_config.quant_method compressed-tensors: vLLM "
                             "then builds the MTP layers an Fp8Config from quantization_config, which never "
                             "reads ignore or config_groups; drop mtp_quant_algo (or set NONE) to inherit it")
        return _compressed_tensors_plan(qc, cfg, str(algo))
    if up != "FP8" and qc.get("quant_method") != "fp8":
        raise ValueError(f"the MTP layers inherit quantization_config quant_method "
                         f"{qc.get('quant_method')!r}, which the harness does not model")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError("FP8 without weight_block_size (per-tensor FP8) is not modelled; "
                         "HY V4 checkpoints use 128x128 blocks")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"weight_block_size must be two positive ints, got {block!r}")
    key = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
    patterns = remap_mtp_exclusions(list(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []),
                                    cfg.num_hidden_layers, cfg.num_mtp_layers)
    plan = Fp8Plan(block=(block[0], block[1]), ue8m0=qc.get("scale_fmt") == "ue8m0", quantized={},
                   algo=str(algo), method="fp8", exclusion_key=key, patterns=tuple(patterns))
    return dataclasses.replace(plan, quantized=_quantized_leaves(cfg, plan))


def _modelopt_plan(qc: dict, cfg: MTPConfig, algo: str) -> Fp8Plan:
    """ModelOptFp8Config's expectations (flat config.json form, see module doc)."""
    if "quantization" in qc:
        raise ValueError("quantization_config.quantization: the nested (hf_quant_config.json) ModelOpt "
                         "form is not modelled; write quant_algo / exclude_modules at the top level")
    qa = qc.get("quant_algo")
    if not qa:
        raise ValueError("quantization_config.quant_algo: missing (vLLM's ModelOpt config refuses it)")
    qa = str(qa).upper()
    if qa in MODELOPT_UNMODELLED:
        raise ValueError(f"quantization_config.quant_algo {qa}: vLLM accepts it, the harness does not "
                         f"build it ({MODELOPT_UNMODELLED[qa]}); use {MODELOPT_ALGO}")
    if qa != MODELOPT_ALGO:
        raise ValueError(f"quantization_config.quant_algo {qa}: not a ModelOpt FP8 algo the harness "
                         f"models (it builds {MODELOPT_ALGO})")
    kv = qc.get("kv_cache_scheme")
    if qc.get("kv_cache_quant_algo") is not None or (isinstance(kv, dict) and kv.get("num_bits") == 8):
        raise ValueError("quantization_config.kv_cache_quant_algo / kv_cache_scheme: an FP8 KV cache is "
                         "not modelled (the harness runs a bf16 cache); set it to null")
    key = "ignore" if "ignore" in qc else "exclude_modules"
    raw = qc.get(key, [])
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        raise ValueError(f"quantization_config.{key} must be a list of strings, got {raw!r}")
    n = cfg.num_hidden_layers
    patterns = remap_mtp_exclusions(raw, n, cfg.num_mtp_layers)
    plan = Fp8Plan(block=DEFAULT_BLOCK, ue8m0=False, quantized={}, algo=algo, method="modelopt",
                   exclusion_key=key, patterns=tuple(patterns), scale_suffix="weight_scale")
    if plan.excluded_by("lm_head") is None:
        raise ValueError(f"quantization_config.{key} does not exclude lm_head: vLLM's ModelOpt config then "
                         f"builds the MTP shared head (prefix lm_head) in FP8, which the harness does not "
                         f"build (list \"lm_head\")")
    if cfg.mlp_moe:
        for i in range(cfg.num_mtp_layers):
            if plan.excluded_by(f"model.layers.{n + i}.mlp.experts") is None:
                raise ValueError(f"quantization_config.{key} does not exclude MTP layer {i}'s routed experts: "
                                 f"ModelOpt FP8 builds them per-tensor static W8A8 (weight and input scale per "
                                 f"expert, whatever quant_algo says), which the harness does not model "
                                 f"(list \"model.mtp_layers.{i}.mlp.experts*\")")
    plan = dataclasses.replace(plan, quantized=_quantized_leaves(cfg, plan))
    _check_block_divisible(cfg, plan, MODELOPT_ALGO)
    return plan


def _check_block_divisible(cfg: MTPConfig, plan: Fp8Plan, what: str) -> None:
    """Every quantized linear's input dim is a multiple of the 128-wide block (ValueError naming them)."""
    shp = layer_shapes(cfg)
    for i, leaves in plan.quantized.items():
        bad = sorted(leaf for leaf in leaves if len(shp[leaf]) == 2 and shp[leaf][1] % DEFAULT_BLOCK[1])
        if bad:
            raise ValueError(f"{what} needs every quantized linear's input dim to be a multiple of "
                             f"{DEFAULT_BLOCK[1]}: MTP layer {i}: " + ", ".join(f"{b} {list(shp[b])}" for b in bad))


def _ct_args(qc: dict, key: str, args, want: dict) -> None:
    """``args`` (a group's weights / input_activations) holds ``want``; ValueError naming the key."""
    if not isinstance(args, dict):
        raise ValueError(f"quantization_config.{key} must be an object, got {args!r}")
    for k, v in want.items():
        if args.get(k) != v:
            raise ValueError(f"quantization_config.{key}.{k} is {args.get(k)!r}: the harness models "
                             f"compressed-tensors FP8 W8A8 with {k} {v!r}")


def _compressed_tensors_plan(qc: dict, cfg: MTPConfig, algo: str) -> Fp8Plan:
    """CompressedTensorsConfig's expectations (see module doc), validating the config."""
    fmt = qc.get("format")
    if fmt != CT_FORMAT:
        raise ValueError(f"quantization_config.format is {fmt!r}: the harness models {CT_FORMAT!r} "
                         f"(FP8 weights stored as float8_e4m3fn)")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups must hold exactly one group (the harness models "
                         f"one scheme for every quantized module), got {groups!r}"[:300])
    (gname, group), = groups.items()
    where = f"config_groups.{gname}"
    if not isinstance(group, dict) or group.get("targets") != ["Linear"]:
        raise ValueError(f"quantization_config.{where}.targets must be [\"Linear\"], got "
                         f"{(group or {}).get('targets') if isinstance(group, dict) else group!r}")
    if group.get("format") not in (None, CT_FORMAT):
        raise ValueError(f"quantization_config.{where}.format is {group.get('format')!r}, expected {CT_FORMAT!r}")
    w = group.get("weights")
    _ct_args(qc, f"{where}.weights", w, {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False})
    strategy = w.get("strategy")
    if strategy not in ("channel", "block"):
        raise ValueError(f"quantization_config.{where}.weights.strategy is {strategy!r}: the harness models "
                         f"'channel' and 'block' FP8 weights")
    if strategy == "block" and w.get("block_structure") != list(DEFAULT_BLOCK):
        raise ValueError(f"quantization_config.{where}.weights.block_structure is {w.get('block_structure')!r}, "
                         f"expected {list(DEFAULT_BLOCK)}")
    act = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
    act.update({"strategy": "token"} if strategy == "channel"
               else {"strategy": "group", "group_size": DEFAULT_BLOCK[1]})
    _ct_args(qc, f"{where}.input_activations", group.get("input_activations"), act)
    if group.get("output_activations") is not None:
        raise ValueError(f"quantization_config.{where}.output_activations: not modelled; set it to null")
    if qc.get("kv_cache_scheme") is not None:
        raise ValueError("quantization_config.kv_cache_scheme: an FP8 KV cache from the checkpoint is not "
                         "modelled (the harness runs a bf16 cache); set it to null")
    raw = qc.get("ignore", [])
    if not isinstance(raw, list):
        raise ValueError(f"quantization_config.ignore must be a list of strings, got {raw!r}"[:300])
    for j, entry in enumerate(raw):
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"quantization_config.ignore[{j}] must be a non-empty string, got {entry!r}")
        if entry.startswith("re:"):
            try:
                re.compile(entry[3:])
            except re.error as exc:
                raise ValueError(f"quantization_config.ignore[{j}] {entry!r}: "
                                 f"not a regular expression ({exc})") from exc
    n = cfg.num_hidden_layers
    aliases = tuple((f"model.layers.{n + i}.", f"model.mtp_layers.{i}.") for i in range(cfg.num_mtp_layers))
    plan = Fp8Plan(block=DEFAULT_BLOCK, ue8m0=False, quantized={}, algo=algo, method=CT_METHOD,
                   exclusion_key="ignore", patterns=tuple(raw), scale_suffix="weight_scale",
                   strategy=strategy, aliases=aliases)
    plan = dataclasses.replace(plan, quantized=_quantized_leaves(cfg, plan))
    for i in range(cfg.num_mtp_layers):  # what vLLM builds must be buildable too (mixed fused parts)
        for module, _ in _QUANT_MODULES.values():
            try:
                plan.vllm_excluded_by(f"model.layers.{n + i}.{module}")
            except ValueError as exc:
                raise ValueError(f"quantization_config.ignore: {exc}") from exc
    if strategy == "block":
        _check_block_divisible(cfg, plan, "block FP8")
    return plan


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
