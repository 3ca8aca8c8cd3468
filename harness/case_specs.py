"""The per-kind payloads of the case registry (``harness.case_registry``): ``Case`` (kind
"reference"), ``GpuCase`` (kind "module") and ``EngineCase`` (kind "engine"), the parameters the
runners read of a case (a record's ``spec``).

Every field with a closed set of values is a ``Literal`` type, checked when the spec is built
(``__post_init__``, ``harness.record_checks``): a spec with a value outside it fails at import,
naming the case, the field and what to do. Open sets that live in torch-importing modules (the
presets, ``acceptance.PATTERNS``, ``harness.regimes``) are held by tests/cpu/test_case_registry.py.

Torch-free (``harness warmup`` and ``compare`` check a case id, exit 2, before anything heavy is
imported): ``reference`` and the presets are imported only when a case's inputs are made.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Literal

from harness.checkpoint.options import QUANTS
from harness.production.engine.graph_regimes import GRAPH_REGIMES
from harness.record_checks import RecordError, all_of, one_of

# the closed sets of the specs' fields (each documented where its field is)
Naming = Literal["mtp_layers", "layers"]
Experts = Literal["split", "fused"]
ExpertScaleSuffix = Literal["weight_scale_inv", "scale"]
WeightsDraw = Literal["stream", "per-tensor"]
KvCacheDtype = Literal["auto", "fp8"]
CtIgnore = Literal["regex", "checkpoint-names"]
EngineTarget = Literal["dummy", "acceptance"]


def _check_common(where: str, spec) -> None:
    """What every spec holds, wherever it was built (the registry, a checkpoint directory's case,
    a saved report read back): a case id and (key, value) overrides."""
    if not isinstance(spec.id, str) or not spec.id.strip():
        raise RecordError(f"{where}: id {spec.id!r} is not a case id; give a non-empty string (it names "
                          "goldens, reports and test ids)")
    if not isinstance(spec.overrides, tuple) or not all(isinstance(o, tuple) and len(o) == 2 for o in spec.overrides):
        raise RecordError(f"{where}: overrides must be a tuple of (HF config key, value) pairs; write "
                          "overrides=((\"key\", value), ...)")


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

    def __post_init__(self):
        _check_common(f"reference case {self.id!r}", self)
        if self.steps < 1 or self.requests < 1 or self.tokens < 1:
            raise RecordError(f"reference case {self.id!r}: steps, requests and tokens must be >= 1")

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
    naming: Naming = "mtp_layers"  # checkpoint names of the MTP layers (harness.checkpoint.names)
    experts: Experts = "split"    # routed experts stored one tensor each or fused
    # checkpoint quantization (harness.checkpoint.options.QUANTS): "bf16", "fp8"
    # (block FP8, float32 weight_scale_inv) or "fp8-ue8m0" (power-of-two scales)
    quant: str = "bf16"  # one of QUANTS
    # FP8 routed-expert scale names: "weight_scale_inv" (fused: _scale_inv) or
    # "scale" (vLLM renames .scale -> .weight_scale_inv, uint8 bytes -> e8m0)
    expert_scale_suffix: ExpertScaleSuffix = "weight_scale_inv"
    # substrings of post-load audit problems that are known production issues:
    # such a case loads non-strictly and the test accepts exactly those problems
    known_audit: tuple = ()
    # a checkpoint directory (``harness.checkpoint.loader``): its config and
    # weights replace preset/overrides; seed/requests/tokens still make the inputs
    ckpt_dir: str | None = None
    # how the seeded weights are drawn (``reference.weights.random_weights``): "stream" (the
    # goldens' one generator) or "per-tensor" (threads; for real dims, where the one serial
    # stream of 1.8 G float64 draws was the GPU tier's critical path)
    weights_draw: WeightsDraw = "stream"
    # modelopt-fp8-pb: MTP layers the checkpoint excludes whole (exclude_modules "<layer>.*")
    bf16_layers: tuple = ()
    # module names (``named_modules``) vLLM must build unquantized: the proof that the case
    # went through the config's exclusion path (checked after loading, see side_by_side)
    expect_unquantized: tuple = ()
    # vLLM's --kv-cache-dtype: "auto" (bf16) or "fp8" (HY V4's sparse layers store the packed
    # fp8_ds_mla rows; the reference reads the same FP8 latent back: reference.kv_cache)
    kv_cache_dtype: KvCacheDtype = "auto"
    # compressed-tensors: how the ignore list names the MTP modules kept bf16
    # (``harness.checkpoint.quant.ct_ignore``: "regex" or "checkpoint-names")
    ct_ignore: CtIgnore = "regex"
    # known vLLM gaps the case exists to show: ((substring of the first audit problem, why), ...).
    # The verdict stays a failure (exit 1, the gap named first); the GPU test asserts it is this one
    # and that nothing else failed, or that the case passes (vLLM fixed)
    upstream_gaps: tuple = ()
    # reload: the seed of weight set B (None: no reload). Set A is ``seed``; the first step's inputs
    # of each run are made from its set's seed
    reload_seed: int | None = None

    def __post_init__(self):
        where = f"module case {self.id!r}"
        _check_common(where, self)
        one_of(where, "naming", self.naming, Naming, "see harness.checkpoint.names for the layouts")
        one_of(where, "experts", self.experts, Experts, "\"fused\" stores the routed experts as one tensor")
        one_of(where, "quant", self.quant, QUANTS, "add a quantization to harness.checkpoint.options.QUANTS "
               "(and write_synthetic) first")
        one_of(where, "expert_scale_suffix", self.expert_scale_suffix, ExpertScaleSuffix,
               "\"scale\" is the fused-experts naming vLLM renames")
        one_of(where, "weights_draw", self.weights_draw, WeightsDraw, "see reference.weights.random_weights")
        one_of(where, "kv_cache_dtype", self.kv_cache_dtype, KvCacheDtype, "vLLM's --kv-cache-dtype values "
               "the reference models")
        one_of(where, "ct_ignore", self.ct_ignore, CtIgnore, "see harness.checkpoint.quant.ct_ignore")
        for gap in self.upstream_gaps:
            if not (isinstance(gap, tuple) and len(gap) == 2):
                raise RecordError(f"{where}: upstream_gaps holds (substring of the first problem, why) pairs")

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
    target: EngineTarget = "dummy"
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
    kv_cache_dtype: KvCacheDtype = "auto"
    # reload: the seed of the drafter's weight set B (None: no reload). The engine generates with set A
    # (``seed``), reloads the drafter in place through vLLM's layerwise reload with set B, generates
    # again and judges that generation against the reference built from set B
    reload_seed: int | None = None

    def __post_init__(self):
        where = f"engine case {self.id!r}"
        _check_common(where, self)
        one_of(where, "target", self.target, EngineTarget, "\"acceptance\" edits the target so drafts are "
               "accepted at planned rates (harness.production.engine.acceptance)")
        one_of(where, "kv_cache_dtype", self.kv_cache_dtype, KvCacheDtype, "vLLM's --kv-cache-dtype values "
               "the replay models")
        all_of(where, "graph_regimes", self.graph_regimes, GRAPH_REGIMES,
               "name a regime of harness.production.engine.graph_regimes.GRAPH_REGIMES (or add it there)")
        if self.num_speculative_tokens < 1:
            raise RecordError(f"{where}: num_speculative_tokens must be >= 1")
