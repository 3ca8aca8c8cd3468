"""The case registry: one record per named case, whatever runs it (in the manner of PyTorch's
OpInfo and ``harness.components``). Every list of cases is derived from ``REGISTRY``:

  harness.cases.CASES / GOLDEN_CASES                 kind "reference": the reference goldens
  harness.production.cases.GPU_CASES                 kind "module", without role "probe"
  harness.production.cases.PROBE_CASES               role "probe"
  harness.production.cases.BISECT_CASES              kind "module", role "bisect": bisect-check's
    (= commands.bisect_check.DEFAULT_BISECT_CASES)        side-by-side set, in its report order
  harness.production.goldens.goldens_gpu.GOLDEN_CASES  kind "module", role "golden"
  harness.production.cases.FP8_CASE_IDS              role "fp8"
  harness.production.cases.MODELOPT_CASE_IDS         role "modelopt"
  harness.production.cases.CT_CASE_IDS               role "compressed-tensors"
  harness.production.cases.RELOAD_CASE_IDS           kind "module", role "reload"
  harness.production.engine.cases.RELOAD_ENGINE_CASES  kind "engine", role "reload"
  harness.production.engine.cases.ENGINE_CASES       kind "engine"
  harness.commands.bisect_check.DEFAULT_BISECT_ENGINE_CASES  kind "engine", role "bisect"
  harness.commands.bisect_check.GRAPH_BISECT_ENGINE_CASES    role "graph-bisect"
  harness.commands.bisect_check.REFERENCE_ONLY_BISECT_CASES  role "reference-bisect"
  harness.commands.bisect_check.CT_BISECT_CASES / RELOAD_BISECT_CASES  roles "ct-bisect" / "reload-bisect"

A record is the case's id, its kind, its roles, the regimes it is chosen for and its parameters
(``spec``: a ``Case``, ``GpuCase`` or ``EngineCase``, the per-kind payload the runners read).
Adding a case is one record here; ``tests/cpu/test_case_registry.py`` pins every derived list (ids
and order) and states the invariants they keep.

Torch-free (``harness warmup`` and ``compare`` check a case id, exit 2, before anything heavy is
imported): ``reference`` and the presets are imported only when a case's inputs are made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import MappingProxyType
from typing import Mapping

KINDS: Mapping[str, str] = MappingProxyType({
    "reference": "the eager reference alone, against its goldens (``harness.golden_check``)",
    "module": "vLLM's HYV4MTP module side by side with the reference (``production.module``)",
    "engine": "vLLM's speculator in a ``vllm.LLM``, replayed by the reference (``production.engine``)",
})

ROLES: Mapping[str, str] = MappingProxyType({
    "golden": "the goldens' case set: reference goldens (kind reference), production goldens and host "
              "baselines (kind module; the same set as the module bisect cases)",
    "bisect": "bisect-check's default set (engine cases first, then the side-by-side cases)",
    "graph-bisect": "what bisect-check --graphs adds: the speculator in CUDA graphs, as served",
    "reference-bisect": "bisect-check's default set beyond the goldens: a deployed configuration's cheapest "
                        "case (FP8 KV cache, compressed-tensors, weights reloaded in place), judged against the "
                        "reference only (no production golden; the run says so)",
    "ct-bisect": "what bisect-check --compressed-tensors adds to --case's cases (the default set holds it)",
    "reload-bisect": "what bisect-check --reload adds to --case's cases (the default set holds it)",
    "fp8": "block-FP8 checkpoints (quant fp8 / fp8-ue8m0): side_by_side --fp8, the FP8 emulation",
    "modelopt": "ModelOpt FP8_PB_WO checkpoints: side_by_side --modelopt",
    "fp8-kv": "served with an FP8 KV cache (kv_cache_dtype fp8: fp8_ds_mla rows on the sparse layers)",
    "compressed-tensors": "compressed-tensors FP8 checkpoints (channel / block weights, an ignore list): "
                          "side_by_side --compressed-tensors",
    "reload": "weights updated in place: set A loaded and run, the drafter reloaded through vLLM's layerwise "
              "reload with set B (every tensor changed), run again and judged against set B; every parameter "
              "compared with a fresh load of set B (side_by_side --reload, the engine's reload cases)",
    "probe": "configs the SM90 kernels refuse (documenting the constraint; expected to raise); "
             "not among GPU_CASES",
})


@dataclasses.dataclass(frozen=True)
class Case:
    """A reference case (kind "reference"): the reference alone, against its goldens."""

    id: str
    preset: str
    overrides: tuple = ()  # ((key, value), ...) applied to the preset's HF dict
    seed: int = 0
    requests: int = 2
    tokens: int = 6
    steps: int = 2

    def hf_config(self) -> dict:
        from harness.presets import preset
        return preset(self.preset, **dict(self.overrides))

    def config(self):
        from reference import MTPConfig
        return MTPConfig.from_hf_dict(self.hf_config())

    def weights(self):
        from reference import random_weights
        return random_weights(self.config(), self.seed)

    def first_step(self):
        from reference import make_case
        return make_case(self.config(), self.seed, self.requests, self.tokens)


@dataclasses.dataclass(frozen=True)
class GpuCase:
    """A side-by-side case (kind "module"): a preset or checkpoint directory, inputs, steps,
    quantization."""

    id: str
    preset: str = "tiny"
    overrides: tuple = ()
    seed: int = 0
    requests: int = 2
    tokens: int = 8
    steps: int = 2
    naming: str = "mtp_layers"
    experts: str = "split"
    # checkpoint quantization (harness.checkpoint.options.QUANTS): "bf16", "fp8"
    # (block FP8, float32 weight_scale_inv) or "fp8-ue8m0" (power-of-two scales)
    quant: str = "bf16"
    # FP8 routed-expert scale names: "weight_scale_inv" (fused: _scale_inv) or
    # "scale" (vLLM renames .scale -> .weight_scale_inv, uint8 bytes -> e8m0)
    expert_scale_suffix: str = "weight_scale_inv"
    # substrings of post-load audit problems that are known production issues:
    # such a case loads non-strictly and the test accepts exactly those problems
    known_audit: tuple = ()
    # a checkpoint directory (``harness.checkpoint.loader``): its config and
    # weights replace preset/overrides; seed/requests/tokens still make the inputs
    ckpt_dir: str | None = None
    # how the seeded weights are drawn (``reference.weights.random_weights``): "stream" (the
    # goldens' one generator) or "per-tensor" (threads; for real dims, where the one serial
    # stream of 1.8 G float64 draws was the GPU tier's critical path)
    weights_draw: str = "stream"
    # modelopt-fp8-pb: MTP layers the checkpoint excludes whole (exclude_modules "<layer>.*")
    bf16_layers: tuple = ()
    # module names (``named_modules``) vLLM must build unquantized: the proof that the case
    # went through the config's exclusion path (checked after loading, see side_by_side)
    expect_unquantized: tuple = ()
    # vLLM's --kv-cache-dtype: "auto" (bf16) or "fp8" (HY V4's sparse layers store the packed
    # fp8_ds_mla rows; the reference reads the same FP8 latent back: reference.kv_cache)
    kv_cache_dtype: str = "auto"
    # compressed-tensors: how the ignore list names the MTP modules kept bf16
    # (``harness.checkpoint.quant.ct_ignore``: "regex" or "checkpoint-names")
    ct_ignore: str = "regex"
    # known vLLM gaps the case exists to show: ((substring of the first audit problem, why), ...).
    # The verdict stays a failure (exit 1, the gap named first); the GPU test asserts it is this one
    # and that nothing else failed, or that the case passes (vLLM fixed)
    upstream_gaps: tuple = ()
    # reload: the seed of weight set B (None: no reload). Set A is ``seed``; the first step's inputs
    # of each run are made from its set's seed
    reload_seed: int | None = None

    def hf_config(self) -> dict:
        """The preset's config with the overrides (no quantization fields: see ``case_inputs``),
        or the checkpoint's ``config.json``."""
        if self.ckpt_dir:
            with open(os.path.join(self.ckpt_dir, "config.json")) as f:
                return json.load(f)
        from harness.presets import preset
        return preset(self.preset, **dict(self.overrides))



@dataclasses.dataclass(frozen=True)
class EngineCase:
    """An engine case (kind "engine"): which ``vllm.LLM`` the engine tier makes."""

    id: str
    overrides: tuple = ()
    preset: str = "tiny"
    seed: int = 0
    num_speculative_tokens: int = 3
    prompt_lens: tuple = (200, 37, 150)  # one longer than index_topk (128): the indexer's choice matters
    max_tokens: int = 32
    gpu_memory_utilization: float = 0.3
    # "dummy": vLLM's dummy-weight target (drafts never accepted); "acceptance": the
    # target edited in place to continue with a token permutation the draft predicts
    # per request at a controlled rate (harness.production.engine.acceptance)
    target: str = "dummy"
    patterns: tuple = ()  # acceptance: one pattern of acceptance.PATTERNS per prompt
    # acceptance rate bounds per pattern the run must show (min, max), engine-measured
    expect_rates: tuple = ()
    # substrings of post-load audit problems that are known vLLM 0.33 issues (reported, accepted)
    known_audit: tuple = ()
    # what the harness must find where vLLM picks a speculator that does not do what the
    # checkpoint asks: (proposer class substring, substring of the first problem, why). The
    # verdict stays a failure (exit 1); the GPU test asserts it is this one
    upstream_gaps: tuple = ()
    # False: enforce_eager (every draft forward tapped); True: the compilation configuration
    # ``vllm serve`` uses by default on the installed release (CUDA graphs; vLLM decides whether
    # torch.compile runs), judged through ``graph_tap``
    graphs: bool = False
    # graphs: the draft-decode paths (harness.production.engine.graph_regimes.GRAPH_REGIMES) the
    # case is for; the verdict fails, naming the regime, when vLLM did not run one of them
    graph_regimes: tuple = ()
    # vLLM's --kv-cache-dtype for the whole engine (target and draft): "auto" or "fp8"
    # (fp8_ds_mla rows on the sparse layers; the replay reads the FP8 latent back: reference.kv_cache)
    kv_cache_dtype: str = "auto"
    # reload: the seed of the drafter's weight set B (None: no reload). The engine generates with set A
    # (``seed``), reloads the drafter in place through vLLM's layerwise reload with set B, generates
    # again and judges that generation against the reference built from set B
    reload_seed: int | None = None


@dataclasses.dataclass(frozen=True)
class CaseRecord:
    """One named case.

    kind     which tier runs it (``KINDS``): "reference", "module" or "engine"
    spec     its parameters, the per-kind payload the runners read: ``Case`` (reference),
             ``GpuCase`` (module), ``EngineCase`` (engine); ``spec.id`` is the case id
    roles    the derived lists it belongs to (``ROLES``)
    regimes  the ``harness.regimes`` quantities it was chosen to exercise above their threshold
             (tests/cpu/test_regimes.py measures it); empty where a case was not chosen for one
    order    ((role, position), ...): its place in a role list whose order is not the registry's
             (bisect-check reports and the goldens' tables keep their order); lists sort by
             position, then registry order
    """

    kind: str
    spec: Case | GpuCase | EngineCase
    roles: frozenset = frozenset()
    regimes: tuple = ()
    order: tuple = ()

    @property
    def id(self) -> str:
        return self.spec.id

    def position(self, role: str) -> int:
        return dict(self.order).get(role, 0)


def _ref(spec: Case, *roles: str) -> CaseRecord:
    return CaseRecord("reference", spec, frozenset(roles))


def _mod(spec: GpuCase, *roles: str, regimes: tuple = (), order: int | None = None) -> CaseRecord:
    """A module case; ``order``: its position in the bisect / golden set (``_BISECT``)."""
    return CaseRecord("module", spec, frozenset(roles), regimes,
                      () if order is None else tuple((r, order) for r in _BISECT if r in roles))


def _eng(spec: EngineCase, *roles: str) -> CaseRecord:
    return CaseRecord("engine", spec, frozenset(roles))


_SMALL_VOCAB = (("vocab_size", 512),)
# index_topk 4 < every context length here, so the indexer's choice matters.
_TOPK4 = (("index_topk", 4),)

_MTP0_GATE = ("model.layers.2.mtp_block.self_attn.linear_gate",)

_ACCEPT = (("enable_ihc", False),)
# the K = 3 non-sharing cases: 7 requests (see engine-graphs-accept-k3-noshare), two of each pattern
# but agree2, one context longer than index_topk
_NOSHARE_PATTERNS = ("accept", "reject", "alternate", "accept", "reject", "alternate", "agree2")
_NOSHARE_PROMPTS = (190, 52, 141, 77, 160, 45, 133)  # the edited target needs a plain residual stream (acceptance doc)

# The module cases of roles bisect and golden are one set: bisect-check's default side-by-side set,
# and the production goldens' and host baselines' case set (a case of the one without the other
# would be judged against the reference only). Their ``regimes`` together cover every regime of
# harness/regimes.py with a threshold (tests/cpu/test_regimes.py); tiny-k2-fp8-ue8m0-fused-scale-long
# adds a block-FP8 checkpoint as stored (e4m3 weights, UE8M0 scales, fused experts with `.scale`
# names): vLLM's FP8 loading, FP8 GEMMs and UE8M0 paths, a regression class the bf16 cases cannot see.
_BISECT = ("bisect", "golden")

REGISTRY: tuple[CaseRecord, ...] = (
    # ---- kind "reference": the reference's goldens (harness/goldens.py) ----
    _ref(Case("tiny-moe-sink-elementwise", "tiny", _SMALL_VOCAB + _TOPK4, seed=1, steps=3), "golden"),
    _ref(Case("tiny-dense-headwise-nosink", "tiny",
              _SMALL_VOCAB + _TOPK4 + (("mlp_layer_types", ["dense", "dense"]), ("gating_type", "headwise"),
                                       ("learnable_sink", False)), seed=2, steps=2), "golden"),
    _ref(Case("tiny-share-indexer", "tiny",
              _SMALL_VOCAB + _TOPK4 + (("index_share_for_mtp_iteration", True),), seed=3, steps=3), "golden"),

    # ---- kind "module": the side by side. Kept small enough for one GPU call of a few minutes;
    # R <= 3 so no length-1 request lands behind a longer one (vLLM's builders expect decode-like
    # requests first) ----
    _mod(GpuCase("tiny-k1", steps=1, seed=1)),
    _mod(GpuCase("tiny-k3-ragged", requests=3, tokens=8, steps=3, seed=2)),
    _mod(GpuCase("tiny-k2-fused-layers", steps=2, seed=3, naming="layers", experts="fused")),
    # The regimes the other default bisect cases leave unexercised (harness/regimes.py): swiglu_limit
    # 10 never binds on the synthetic O(1) activations, 1.5 clamps ~20 % of the routed SwiGLU
    # elements (removing the clamp moves mlp.out by ~15x its tolerance, CPU-measured); headwise gate;
    # fused experts and layers naming (what tiny-k2-fused-layers brought to the bisect set).
    _mod(GpuCase("tiny-k2-clamp-headwise", overrides=(("swiglu_limit", 1.5), ("gating_type", "headwise")), steps=2,
                 seed=22, naming="layers", experts="fused"),
         *_BISECT, regimes=("routed_clamp_frac", "headwise_gate_rows"), order=2),
    _mod(GpuCase("tiny-k2-nosink", overrides=(("learnable_sink", False),), steps=2, seed=4)),
    # index sharing, K = 3 and a heavy sink
    _mod(GpuCase("tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), requests=3,
                 tokens=8, steps=3, seed=5),
         *_BISECT, regimes=("index_share_steps", "draft_steps", "sink_mass_mean", "elementwise_gate_rows"), order=0),
    # contexts longer than index_topk (128): the indexer's choice matters; routing near-ties
    _mod(GpuCase("tiny-k2-long", requests=2, tokens=160, steps=2, seed=6),
         *_BISECT, regimes=("topk_selecting_rows_frac", "routing_near_tie_rows", "indexer_ue8m0_rounded_frac"),
         order=1),
    # a request longer than the MLA decode threshold (256): sparse prefill kernel
    _mod(GpuCase("tiny-k2-long-prefill", requests=2, tokens=300, steps=2, seed=7)),
    _mod(GpuCase("tiny-k3-long-share", overrides=(("index_share_for_mtp_iteration", True),), requests=2,
                 tokens=160, steps=3, seed=8)),
    # index_topk probes: the decode top-k kernels take 512/1024/2048 on the fast
    # paths and fall back to per-row top-k otherwise; FlashMLA reads topk-wide rows
    _mod(GpuCase("tiny-k2-topk512", overrides=(("index_topk", 512),), requests=2, tokens=160, steps=2, seed=9)),
    _mod(GpuCase("tiny-k2-small-preset", preset="small", requests=2, tokens=40, steps=2, seed=11)),
    _mod(GpuCase("tiny-k2-dense-mlp", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2, seed=12)),
    _mod(GpuCase("tiny-k2-headwise", overrides=(("gating_type", "headwise"),), steps=2, seed=13)),
    # positions past original_max_position_embeddings: the YaRN blend and mscale matter
    _mod(GpuCase("tiny-k2-yarn", overrides=(("rope_parameters", {
        "rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0}),), requests=2, tokens=150, steps=2, seed=14)),
    # two MTP layers: the proposers never pass spec_step_idx, so layer 0 serves every step
    # (vLLM requires num_speculative_tokens divisible by n_predict = 2). Known issue:
    # HYV4MTP.load_weights maps lm_head.weight onto MTP layer 0's shared_head only,
    # so layer 1's head stays uninitialised (harmless while layer 0 serves every step).
    _mod(GpuCase("tiny-k2-two-mtp-layers", overrides=(("num_nextn_predict_layers", 2),), steps=2, seed=15,
                 known_audit=("model.layers.3.shared_head.head.weight",))),
    _mod(GpuCase("tiny-k3-batch8", requests=8, tokens=64, steps=3, seed=17)),
    # HYV4Config's MTP dimensions (hidden 2816, 32 heads, 256 experts top-8, v 256,
    # index_topk 2048; vocab cut to 8192): ~13 GB of float64 reference weights,
    # the reference replays take tens of seconds on the host CPU
    _mod(GpuCase("real-dims-k2", preset="real-dims", requests=2, tokens=24, steps=2, seed=21,
                 weights_draw="per-tensor")),
    # FP8 checkpoints (mtp_quant_algo FP8, 128x128 blocks): production loads the
    # stored e4m3 weights + scales through vLLM's FP8 paths (Fp8LinearMethod,
    # Fp8MoEMethod, FP8 indexer wk dequant); the reference runs on the exact
    # dequantized weights. Contexts (160, 157) longer than index_topk 128.
    _mod(GpuCase("tiny-k2-fp8-split-long", requests=2, tokens=160, steps=2, seed=18, quant="fp8"), "fp8"),
    _mod(GpuCase("tiny-k2-fp8-ue8m0-fused-scale-long", requests=2, tokens=160, steps=2, seed=19,
                 quant="fp8-ue8m0", experts="fused", expert_scale_suffix="scale"),
         "fp8", *_BISECT, regimes=("weight_ue8m0_rounded_frac",), order=3),
    # ModelOpt FP8_PB_WO (quant_method modelopt, no mtp_quant_algo: the MTP layers inherit it):
    # the checkpoint-named exclude_modules reach the draft only through HYV4MTP's remap. The gate
    # by its exact name, the routed experts by the wildcard model.mtp_layers.0.mlp.experts*
    # (ModelOpt FP8 experts are per-tensor static W8A8, not modelled), lm_head by name.
    _mod(GpuCase("tiny-k2-modelopt-pb-long", requests=2, tokens=160, steps=2, seed=23, quant="modelopt-fp8-pb",
                 expect_unquantized=_MTP0_GATE + ("model.layers.2.mtp_block.mlp.experts.routed_experts",
                                                  "model.layers.2.shared_head.head")), "modelopt"),
    # dense MLP: every linear but the gate FP8; the exclusion bug (exclusions not remapped)
    # quantizes only linears here, so it surfaces as a load failure, not a crash
    _mod(GpuCase("tiny-k2-modelopt-pb-dense", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2,
                 seed=24, quant="modelopt-fp8-pb", expect_unquantized=_MTP0_GATE + ("model.layers.2.shared_head.head",)),
         "modelopt"),
    # the whole MTP layer excluded by the wildcard model.mtp_layers.0.* (a bf16 MTP head under an
    # FP8 backbone's ModelOpt config); dense MLP for the same reason as above
    _mod(GpuCase("tiny-k2-modelopt-layer-bf16-dense", overrides=(("mlp_layer_types", ["dense", "dense"]),),
                 steps=2, seed=25, quant="modelopt-fp8-pb", bf16_layers=(0,),
                 expect_unquantized=_MTP0_GATE + tuple(f"model.layers.2.mtp_block.{m}" for m in (
                     "self_attn.fused_qkv_a_proj", "self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj",
                     "self_attn.indexer.wq_b", "mlp.gate_up_proj", "mlp.down_proj"))),
         "modelopt"),
    # FP8 KV cache (--kv-cache-dtype fp8): the draft's sparse MLA stores vLLM's packed fp8_ds_mla
    # rows (e4m3 latent, a power-of-two scale per tile of 128, bf16 rope) and the FP8 sparse
    # decode kernel reads them back; contexts (160, 157) longer than index_topk 128
    _mod(GpuCase("tiny-k2-long-fp8kv", requests=2, tokens=160, steps=2, seed=26, kv_cache_dtype="fp8"), "fp8-kv",
         "reference-bisect"),
    # compressed-tensors FP8 (quant_method compressed-tensors, no mtp_quant_algo: inherited). The ignore
    # list in llm-compressor's form (re:.*self_attn\.linear_gate$ ...) matches the draft prefixes as
    # they are: vLLM keeps the gate bf16 and builds the rest FP8 (CompressedTensorsW8A8Fp8 linears,
    # the routed experts through the compressed-tensors FP8 MoE method). Channel: one float32 scale per
    # output row, per-token activations; block: 128x128 scales, per-128-group activations.
    _mod(GpuCase("tiny-k2-ct-fp8-channel-long", requests=2, tokens=160, steps=2, seed=26,
                 quant="compressed-tensors-fp8", expect_unquantized=_MTP0_GATE + ("model.layers.2.shared_head.head",)),
         "compressed-tensors", "ct-bisect", "reference-bisect"),
    _mod(GpuCase("tiny-k2-ct-fp8-block-long", requests=2, tokens=160, steps=2, seed=27,
                 quant="compressed-tensors-fp8-block",
                 expect_unquantized=_MTP0_GATE + ("model.layers.2.shared_head.head",)),
         "compressed-tensors"),
    # the ignore list names the MTP modules by their checkpoint names (model.mtp_layers.0.self_attn.linear_gate,
    # re:model\.mtp_layers\.0\.mlp\.experts\..*): HYV4MTP's remap reads ignored_layers / exclude_modules
    # only, so vLLM builds the bf16 gate and routed experts FP8 with no scale (the vllm-plugin-das #34 class)
    _mod(GpuCase("tiny-k2-ct-fp8-mtp-names", steps=2, seed=28, quant="compressed-tensors-fp8",
                 ct_ignore="checkpoint-names",
                 expect_unquantized=_MTP0_GATE + ("model.layers.2.mtp_block.mlp.experts.routed_experts",
                                                  "model.layers.2.shared_head.head"),
                 upstream_gaps=(("vLLM gap: HYV4MTP._remap_mtp_quant_exclusions reads only ignored_layers",
                                 "compressed-tensors' ignore is not among _MTP_QUANT_EXCLUSION_ATTRS (mtp.py): "
                                 "checkpoint-named MTP entries never reach the draft prefixes, so the bf16 "
                                 "linear_gate and routed experts are built FP8 without a scale"),)),
         "compressed-tensors"),
    # weights updated in place: set A (seed) loaded and run, the drafter reloaded with set B
    # (reload_seed: every stored tensor differs, the sink, expert bias and FP8 scales included) through
    # vLLM's layerwise reload_weights, run again and judged against set B's reference
    _mod(GpuCase("tiny-k2-reload", steps=2, seed=41, reload_seed=42), "reload", "reload-bisect", "reference-bisect"),
    _mod(GpuCase("tiny-k2-fp8-reload", steps=2, seed=43, reload_seed=44, quant="fp8"), "reload"),
    # configs the SM90 kernels refuse (kept to document the constraint; expected to raise)
    _mod(GpuCase("probe-topk4", overrides=(("index_topk", 4),), requests=2, tokens=8, steps=2, seed=10), "probe"),
    # "layers" naming with two MTP layers: the loader recognises only
    # model.layers.<n + i> for i < max(num_nextn_predict_layers - 1, 1)
    _mod(GpuCase("probe-two-mtp-layers-naming", overrides=(("num_nextn_predict_layers", 2),), steps=2,
                 seed=16, naming="layers"), "probe"),

    # ---- kind "engine": vLLM's speculator in a vllm.LLM ----
    # index sharing: step 0 runs the indexer, steps 1..K-1 reuse its rows compacted to the sampled rows
    _eng(EngineCase("engine-tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), seed=31)),
    # no sharing: every draft step runs the indexer
    _eng(EngineCase("engine-tiny-k2", num_speculative_tokens=2, seed=32, prompt_lens=(160, 9, 140))),
    # drafts accepted: near 100 % / 0 % / 1/3 / 2/3 per request in one batch (K = 3), index
    # sharing (compaction + skip-top-k at every step), one context longer than index_topk
    _eng(EngineCase("engine-accept-k3-share", overrides=_ACCEPT + (("index_share_for_mtp_iteration", True),),
                    seed=33, target="acceptance", patterns=("accept", "reject", "alternate", "agree2"),
                    prompt_lens=(200, 40, 150, 61),
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.1), ("alternate", 0.2, 0.5),
                                  ("agree2", 0.5, 0.8))), "bisect"),
    # two MTP layers, K = 2, no index sharing: MultiModuleMTPSpeculator (layer k mod 2 at step k)
    _eng(EngineCase("engine-accept-k2-two-layers", overrides=_ACCEPT + (("num_nextn_predict_layers", 2),), seed=34,
                    num_speculative_tokens=2, target="acceptance", patterns=("accept", "reject", "alternate"),
                    prompt_lens=(180, 50, 90),
                    # (reject: measured 4 of 54 drafts accepted, reference agreeing: the draft's
                    # attention/MoE occasionally lands a disagree token on the right code)
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75))),
         "bisect"),
    # two MTP layers with index sharing: the speculator vLLM picks for it differs by release
    # (MultiModuleMTPSpeculator, or MTPSpeculator running layer 0 at every step); the report's
    # runner.mtp_layers_run says which, and the replay judges against that layer. Both layers
    # draft through the same acceptance code, so the planned rates hold either way.
    _eng(EngineCase("engine-accept-k2-two-layers-share",
                    overrides=_ACCEPT + (("num_nextn_predict_layers", 2), ("index_share_for_mtp_iteration", True)),
                    seed=35, num_speculative_tokens=2, target="acceptance",
                    patterns=("accept", "reject", "alternate"), prompt_lens=(180, 50, 90),
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75)),
                    upstream_gaps=(("MultiModule", "attn.topk rows are not the reference's (shared step 0 rows",
                                    "MultiModuleMTPSpeculator does not implement index_share_for_mtp_iteration: its "
                                    "steps >= 1 run their own indexer instead of reusing step 0's rows (later vLLM "
                                    "picks MTPSpeculator for such a checkpoint: config/speculative.py "
                                    "use_multi_module_mtp, 'TODO: Support index_share_for_mtp_iteration in "
                                    "MultiModuleMTPSpeculator')"),))),
    # CUDA graphs as served: engine-accept-k3-share with vLLM's default compilation configuration.
    # 4 requests (a capture size: FULL draft-decode graphs without padding); the batch shrinks as
    # the near-100 % request finishes first, so later steps run 3 requests padded to 4
    _eng(EngineCase("engine-graphs-accept-k3-share", overrides=_ACCEPT + (("index_share_for_mtp_iteration", True),),
                    seed=33, target="acceptance", patterns=("accept", "reject", "alternate", "agree2"),
                    prompt_lens=(200, 40, 150, 61), graphs=True,
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.1), ("alternate", 0.2, 0.5),
                                  ("agree2", 0.5, 0.8)),
                    graph_regimes=("decode_full_graph", "draft_steps_ge2", "index_sharing", "batch_shrink",
                                   "prefill_full_graph")), "graph-bisect"),
    # K = 3 WITHOUT index sharing under CUDA graphs: draft steps >= 2 run the indexer over per-step
    # metadata (on HY V4 vLLM rebuilds it on the host per step and replays a FULL graph: where a
    # graph replays state frozen at capture); 7 requests: a capture size of neither release (0.33.0
    # captures 1, 2, 4, 8, ...; 0.34.0 1-6, 8, ...: 3 requests ran unpadded there), so the decode
    # graph runs padded rows; the near-100 % requests finish first (the batch shrinks)
    _eng(EngineCase("engine-graphs-accept-k3-noshare", overrides=_ACCEPT, seed=37, target="acceptance",
                    patterns=_NOSHARE_PATTERNS, prompt_lens=_NOSHARE_PROMPTS, graphs=True,
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.2, 0.5),
                                  ("agree2", 0.5, 0.8)),
                    graph_regimes=("decode_full_graph", "draft_steps_ge2", "indexer_at_step_ge2",
                                   "decode_metadata_per_step", "padded_rows", "batch_shrink")), "graph-bisect"),
    # its eager twin: the same generation with every draft forward tapped (where the capture-only
    # mutants of the non-sharing decode must pass), and the eager K = 3 path without sharing
    _eng(EngineCase("engine-accept-k3-noshare", overrides=_ACCEPT, seed=37, target="acceptance",
                    patterns=_NOSHARE_PATTERNS, prompt_lens=_NOSHARE_PROMPTS,
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.2, 0.5),
                                  ("agree2", 0.5, 0.8)))),
    # 3 requests, K = 2, no index sharing (padded rows are recorded, not declared: on an H200 neither
    # release's graph regime table showed a padded decode replay for this case)
    # (the indexer runs inside the decode graph), requests finishing at different steps
    _eng(EngineCase("engine-graphs-accept-k2-padded", overrides=_ACCEPT, seed=36, num_speculative_tokens=2,
                    target="acceptance", patterns=("accept", "reject", "alternate"), prompt_lens=(170, 45, 133),
                    graphs=True,
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75)),
                    graph_regimes=("decode_full_graph", "batch_shrink"))),
    # FP8 KV cache (--kv-cache-dtype fp8, the whole engine: the sparse layers store fp8_ds_mla rows):
    # eager, every draft forward tapped and replayed over the reference's FP8 latent; then as
    # served (CUDA graphs), 3 requests padded, no index sharing
    _eng(EngineCase("engine-accept-k3-share-fp8kv", overrides=_ACCEPT + (("index_share_for_mtp_iteration", True),),
                    seed=37, target="acceptance", patterns=("accept", "reject", "alternate"),
                    prompt_lens=(200, 40, 150), kv_cache_dtype="fp8",
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.2, 0.5))),
         "fp8-kv"),
    _eng(EngineCase("engine-graphs-accept-k2-padded-fp8kv", overrides=_ACCEPT, seed=38, num_speculative_tokens=2,
                    target="acceptance", patterns=("accept", "reject", "alternate"), prompt_lens=(170, 45, 133),
                    graphs=True, kv_cache_dtype="fp8",
                    expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75)),
                    graph_regimes=("decode_full_graph", "batch_shrink")),
         "fp8-kv"),
    # weights updated in place in a running engine: generate with set A (seed), reload the drafter through
    # vLLM's layerwise reload with set B (reload_seed), generate again, judge that generation against set
    # B's reference. Dummy target (no acceptance edit: it would tie the draft to set A's embedding/head)
    _eng(EngineCase("engine-reload-k2", num_speculative_tokens=2, seed=45, reload_seed=46, prompt_lens=(160, 9, 140)),
         "reload"),
    _eng(EngineCase("engine-graphs-reload-k2", num_speculative_tokens=2, seed=45, reload_seed=46,
                    prompt_lens=(160, 9, 140), graphs=True, graph_regimes=("decode_full_graph",)),
         "reload"),
)

BY_ID: Mapping[str, CaseRecord] = MappingProxyType({r.id: r for r in REGISTRY})


def records(role: str | None = None, kind: str | None = None, without: str | None = None) -> list[CaseRecord]:
    """The records of ``kind`` (any when None) that have ``role`` (any when None) and not role
    ``without``: in registry order, or, for a role, by each record's position in it (``order``)."""
    for r in (role, without):
        if r is not None and r not in ROLES:
            raise KeyError(f"unknown role {r!r}; known: {', '.join(ROLES)}")
    if kind is not None and kind not in KINDS:
        raise KeyError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = [r for r in REGISTRY if (kind is None or r.kind == kind) and (role is None or role in r.roles)
           and (without is None or without not in r.roles)]
    return sorted(out, key=lambda r: r.position(role)) if role is not None else out


def ids(role: str | None = None, kind: str | None = None, without: str | None = None) -> tuple[str, ...]:
    """The case ids of ``records(role, kind, without)``, in its order."""
    return tuple(r.id for r in records(role, kind, without))


def specs(role: str | None = None, kind: str | None = None, without: str | None = None) -> dict:
    """{id: spec} of ``records(role, kind, without)``, in its order."""
    return {r.id: r.spec for r in records(role, kind, without)}
