"""The case registry: one record per named case, whatever runs it (in the manner of PyTorch's
OpInfo and ``harness.components``), and the only list of cases. Every set of cases is a query of
it, written where it is used:

  ids(role=..., kind=...)       the case ids of a role / kind, in the role's order (``order``)
  specs(role=..., kind=...)     {id: spec} of the same records
  records(...)                  the records themselves
  spec(case_id, kind=...)       one case's spec; ``KeyError`` naming the known ids

  e.g. the module cases every single-GPU command lists: ``specs(kind="module", without="probe")``;
  bisect-check's side-by-side set, in its report order: ``ids(role="bisect", kind="module")``;
  the multi-GPU test's cases on N GPUs: ``records(role="tp", max_gpus=N)``.

A record is the case's id, its kind, its roles, the regimes it is chosen for, the GPUs it needs
and its parameters (``spec``: a ``Case``, ``GpuCase`` or ``EngineCase`` of ``harness.case_specs``,
the per-kind payload the runners read). Each field with a closed set of values is a ``Literal``
type, and a record checks itself when it is built (``CaseRecord.__post_init__``): a record that
breaks a rule (an unknown role, a role its kind cannot hold, a spec that contradicts its role)
fails at import, naming the case and what to do. Adding a case is one record here (plus its
goldens where it is a golden case); ``tests/cpu/test_case_registry.py`` holds the invariants the
queries keep, not the ids.

Torch-free (``harness warmup`` and ``compare`` check a case id, exit 2, before anything heavy is
imported): ``reference`` and the presets are imported only when a case's inputs are made.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Literal, Mapping

from harness.case_specs import Case, EngineCase, GpuCase
from harness.record_checks import RecordError, all_of, choices, one_of

__all__ = ["BY_ID", "Case", "CaseRecord", "EngineCase", "GpuCase", "KINDS", "REGISTRY", "ROLES", "ids", "records",
           "spec", "specs"]

Kind = Literal["reference", "module", "engine"]
Role = Literal["golden", "bisect", "graph-bisect", "reference-bisect", "ct-bisect", "reload-bisect", "fp8",
               "modelopt", "fp8-kv", "compressed-tensors", "reload", "probe", "tp"]

KINDS: Mapping[str, str] = MappingProxyType({
    "reference": "the eager reference alone, against its goldens (``harness.goldens.reference``)",
    "module": "vLLM's HYV4MTP module side by side with the reference (``production.module``)",
    "engine": "vLLM's speculator in a ``vllm.LLM``, replayed by the reference (``production.engine``)",
})

# the spec type of each kind
SPEC_TYPES: Mapping[str, type] = MappingProxyType({"reference": Case, "module": GpuCase, "engine": EngineCase})

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
             "not among the cases a command runs by default",
    "tp": "tensor parallelism: tests/gpu/test_multigpu.py runs it at TP = N against TP = 1 and the reference "
          "(a case of ``gpus`` N > 1 is written for TP = N and is in no single-GPU list)",
})

# the kinds that may hold each role (a role's lists are read by one tier's commands)
ROLE_KINDS: Mapping[str, tuple] = MappingProxyType({
    "golden": ("reference", "module"), "bisect": ("module", "engine"), "graph-bisect": ("engine",),
    "fp8-kv": ("module", "engine"), "reload": ("module", "engine"),
    **{r: ("module",) for r in ("reference-bisect", "ct-bisect", "reload-bisect", "fp8", "modelopt",
                                "compressed-tensors", "probe", "tp")},
})

if set(KINDS) != set(choices(Kind)) or set(ROLES) != set(choices(Role)) or set(ROLE_KINDS) != set(ROLES):
    raise RecordError("harness.case_registry: Kind / Role, KINDS / ROLES and ROLE_KINDS name different sets; "
                      "declare a kind or role in all of them")

_QUANT_ROLES = {"fp8": ("fp8", "fp8-ue8m0"), "modelopt": ("modelopt-fp8-pb",),
                "compressed-tensors": ("compressed-tensors-fp8", "compressed-tensors-fp8-block")}


@dataclasses.dataclass(frozen=True)
class CaseRecord:
    """One named case, checked when it is built (``__post_init__``: a broken record fails at import).

    kind     which tier runs it (``KINDS``): "reference", "module" or "engine"
    spec     its parameters, the per-kind payload the runners read (``SPEC_TYPES``): ``Case``
             (reference), ``GpuCase`` (module), ``EngineCase`` (engine); ``spec.id`` is the case id
    roles    the sets it belongs to (``ROLES``; ``ROLE_KINDS``: the kinds that may hold each)
    regimes  the ``harness.regimes`` quantities it was chosen to exercise above their threshold
             (tests/cpu/test_regimes.py measures it; tests/cpu/test_case_registry.py checks the names,
             since harness.regimes imports torch); empty where a case was not chosen for one
    order    ((role, position), ...): its place in a role list whose order is not the registry's
             (bisect-check reports, the goldens' tables and the multi-GPU test keep their order);
             lists sort by position, then registry order
    gpus     the GPUs one run needs: 1, or N for a case written for tensor parallelism at TP = N
             (role "tp": its shapes shard only so); such a case is in no single-GPU list
             (``records(max_gpus=1)``, the default)
    """

    kind: Kind
    spec: Case | GpuCase | EngineCase
    roles: frozenset = frozenset()
    regimes: tuple = ()
    order: tuple = ()
    gpus: int = 1

    def __post_init__(self):
        where = f"case {getattr(self.spec, 'id', self.spec)!r}"
        one_of(where, "kind", self.kind, Kind, "declare a new tier in Kind, KINDS and SPEC_TYPES first")
        if type(self.spec) is not SPEC_TYPES[self.kind]:
            raise RecordError(f"{where}: kind {self.kind!r} takes a {SPEC_TYPES[self.kind].__name__} spec, not "
                              f"{type(self.spec).__name__}; build the spec of its kind")
        if not isinstance(self.roles, frozenset):
            raise RecordError(f"{where}: roles must be a frozenset (the record helpers _ref / _mod / _eng build it)")
        all_of(where, "roles", sorted(self.roles), Role, "declare a new role in Role, ROLES and ROLE_KINDS")
        for role in sorted(self.roles):
            if self.kind not in ROLE_KINDS[role]:
                raise RecordError(f"{where}: role {role!r} is for kind {' / '.join(ROLE_KINDS[role])} cases, "
                                  f"not {self.kind!r}; drop the role or change ROLE_KINDS and its readers")
        if not isinstance(self.regimes, tuple) or not all(isinstance(r, str) for r in self.regimes):
            raise RecordError(f"{where}: regimes must be a tuple of harness.regimes.REGIMES names")
        all_of(where, "order's roles", [r for r, _ in self.order], sorted(self.roles),
               "give a position only in a role the case has")
        if not isinstance(self.gpus, int) or self.gpus < 1 or (self.gpus > 1 and "tp" not in self.roles):
            raise RecordError(f"{where}: gpus={self.gpus!r}; give 1, or N > 1 for a case of role \"tp\" written "
                              "for TP = N")
        self._check_roles_match_spec(where)

    def _check_roles_match_spec(self, where: str) -> None:
        """A role that states a property of the spec holds it (the role is the list its readers use)."""
        s, roles = self.spec, self.roles
        for role, quants in _QUANT_ROLES.items():
            if role in roles and s.quant not in quants:
                raise RecordError(f"{where}: role {role!r} needs quant in {quants}, not {s.quant!r}; "
                                  "fix the quant or drop the role")
        reload_seed = getattr(s, "reload_seed", None)
        if ("reload" in roles) != (reload_seed is not None) or (reload_seed is not None and reload_seed == s.seed):
            raise RecordError(f"{where}: role \"reload\" goes with a reload_seed other than seed, and only "
                              "there; set both or neither")
        if ("fp8-kv" in roles) != (getattr(s, "kv_cache_dtype", "auto") != "auto"):
            raise RecordError(f"{where}: role \"fp8-kv\" goes with kv_cache_dtype=\"fp8\", and only there")
        for extra, base in (("ct-bisect", "compressed-tensors"), ("reload-bisect", "reload")):
            if extra in roles and base not in roles:
                raise RecordError(f"{where}: role {extra!r} needs role {base!r} too")
        if self.kind == "engine":
            if bool(s.graph_regimes) != s.graphs:
                raise RecordError(f"{where}: graph_regimes are declared exactly on CUDA-graph cases (graphs=True): "
                                  "name the draft paths a graph case is for, none on an eager case")
            if "graph-bisect" in roles and not s.graphs or "bisect" in roles and s.graphs:
                raise RecordError(f"{where}: role \"graph-bisect\" is for CUDA-graph engine cases, \"bisect\" "
                                  "for eager ones")
            if (s.target == "acceptance") != bool(s.patterns) or (s.patterns and len(s.patterns) != len(s.prompt_lens)):
                raise RecordError(f"{where}: target=\"acceptance\" takes one pattern per prompt "
                                  f"({len(s.patterns)} patterns, {len(s.prompt_lens)} prompts); a dummy target none")

    @property
    def id(self) -> str:
        return self.spec.id

    def position(self, role: str) -> int:
        return dict(self.order).get(role, 0)


def _ref(spec: Case, *roles: str) -> CaseRecord:
    return CaseRecord("reference", spec, frozenset(roles))


def _mod(spec: GpuCase, *roles: str, regimes: tuple = (), order: int | None = None, tp: int | None = None,
         gpus: int = 1) -> CaseRecord:
    """A module case; ``order``: its position in the bisect / golden set (``_BISECT``); ``tp``: its
    position in role "tp" (the multi-GPU test's order), which it then has."""
    pos = () if order is None else tuple((r, order) for r in _BISECT if r in roles)
    if tp is not None:
        roles, pos = (*roles, "tp"), (*pos, ("tp", tp))
    return CaseRecord("module", spec, frozenset(roles), regimes, pos, gpus)


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
    _mod(GpuCase("tiny-k2-fused-layers", steps=2, seed=3, naming="layers", experts="fused"), tp=2),
    # The regimes the other default bisect cases leave unexercised (harness/regimes.py): swiglu_limit
    # 10 never binds on the synthetic O(1) activations, 1.5 clamps ~20 % of the routed SwiGLU
    # elements (removing the clamp moves mlp.out by ~15x its tolerance, CPU-measured); headwise gate;
    # fused experts and layers naming (what tiny-k2-fused-layers brought to the bisect set).
    _mod(GpuCase("tiny-k2-clamp-headwise", overrides=(("swiglu_limit", 1.5), ("gating_type", "headwise")), steps=2,
                 seed=22, naming="layers", experts="fused"),
         *_BISECT, regimes=("routed_clamp_frac", "headwise_gate_rows"), order=2),
    _mod(GpuCase("tiny-k2-nosink", overrides=(("learnable_sink", False),), steps=2, seed=4), tp=3),
    # index sharing, K = 3 and a heavy sink
    _mod(GpuCase("tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), requests=3,
                 tokens=8, steps=3, seed=5),
         *_BISECT, regimes=("index_share_steps", "draft_steps", "sink_mass_mean", "elementwise_gate_rows"), order=0,
         tp=0),
    # contexts longer than index_topk (128): the indexer's choice matters; routing near-ties
    _mod(GpuCase("tiny-k2-long", requests=2, tokens=160, steps=2, seed=6),
         *_BISECT, regimes=("topk_selecting_rows_frac", "routing_near_tie_rows", "indexer_ue8m0_rounded_frac"),
         order=1, tp=1),
    # a request longer than the MLA decode threshold (256): sparse prefill kernel
    _mod(GpuCase("tiny-k2-long-prefill", requests=2, tokens=300, steps=2, seed=7)),
    _mod(GpuCase("tiny-k3-long-share", overrides=(("index_share_for_mtp_iteration", True),), requests=2,
                 tokens=160, steps=3, seed=8)),
    # index_topk probes: the decode top-k kernels take 512/1024/2048 on the fast
    # paths and fall back to per-row top-k otherwise; FlashMLA reads topk-wide rows
    _mod(GpuCase("tiny-k2-topk512", overrides=(("index_topk", 512),), requests=2, tokens=160, steps=2, seed=9)),
    _mod(GpuCase("tiny-k2-small-preset", preset="small", requests=2, tokens=40, steps=2, seed=11)),
    _mod(GpuCase("tiny-k2-dense-mlp", overrides=(("mlp_layer_types", ["dense", "dense"]),), steps=2, seed=12), tp=4),
    _mod(GpuCase("tiny-k2-headwise", overrides=(("gating_type", "headwise"),), steps=2, seed=13), tp=5),
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
    _mod(GpuCase("tiny-k3-batch8", requests=8, tokens=64, steps=3, seed=17), tp=6),
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
                 seed=24, quant="modelopt-fp8-pb",
                 expect_unquantized=_MTP0_GATE + ("model.layers.2.shared_head.head",)),
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
    # tensor parallelism only (tests/gpu/test_multigpu.py, 2 GPUs): FP8 at TP = 2 needs 128-divisible
    # per-rank shards; the tiny preset's routed intermediate (128) splits to 64 (vLLM refuses), so
    # this case doubles it. Not of role "fp8": side_by_side --fp8 and the FP8 emulation run on one GPU
    _mod(GpuCase("tp2-k2-fp8-split-long", overrides=(("moe_intermediate_size", 256),), requests=2, tokens=160,
                 steps=2, seed=18, quant="fp8"), tp=7, gpus=2),

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
if len(BY_ID) != len(REGISTRY):
    raise RecordError("harness.case_registry: case ids "
                      f"{sorted({r.id for r in REGISTRY if [x.id for x in REGISTRY].count(r.id) > 1})} are declared "
                      "more than once; give each case its own id (it names goldens, reports and test ids)")


def records(role: str | None = None, kind: str | None = None, without: str | None = None,
            max_gpus: int = 1) -> list[CaseRecord]:
    """The records of ``kind`` (any when None) that have ``role`` (any when None), not role ``without``,
    and run on at most ``max_gpus`` GPUs (1: the single-GPU cases every command lists): in registry
    order, or, for a role, by each record's position in it (``order``)."""
    for r in (role, without):
        if r is not None and r not in ROLES:
            raise KeyError(f"unknown role {r!r}; known: {', '.join(ROLES)}")
    if kind is not None and kind not in KINDS:
        raise KeyError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    out = [r for r in REGISTRY if (kind is None or r.kind == kind) and (role is None or role in r.roles)
           and (without is None or without not in r.roles) and r.gpus <= max_gpus]
    return sorted(out, key=lambda r: r.position(role)) if role is not None else out


def ids(role: str | None = None, kind: str | None = None, without: str | None = None,
        max_gpus: int = 1) -> tuple[str, ...]:
    """The case ids of ``records(role, kind, without, max_gpus)``, in its order."""
    return tuple(r.id for r in records(role, kind, without, max_gpus))


def specs(role: str | None = None, kind: str | None = None, without: str | None = None,
          max_gpus: int = 1) -> dict:
    """{id: spec} of ``records(role, kind, without, max_gpus)``, in its order."""
    return {r.id: r.spec for r in records(role, kind, without, max_gpus)}


def spec(case_id: str, kind: str | None = None, without: str | None = None):
    """The spec of case ``case_id`` among ``specs(kind=kind, without=without)``; ``KeyError`` naming
    the known ids (of that kind) otherwise."""
    known = specs(kind=kind, without=without)
    if case_id not in known:
        raise KeyError(f"unknown case {case_id!r}; known: {', '.join(known)}")
    return known[case_id]
