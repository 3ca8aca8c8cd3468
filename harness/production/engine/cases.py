"""The engine cases: which ``vllm.LLM`` runs the engine tier makes (torch-free: ``harness
warmup`` and ``compare`` check a case id, exit 2, before anything heavy is imported)."""

from __future__ import annotations

import dataclasses
import os

# A fixed KV cache size for the engine (GiB): vLLM then skips its memory profiling, which fails
# when another process on the same GPU allocates or frees memory meanwhile
ENGINE_KV_GIB_ENV = "HYV4_ENGINE_KV_CACHE_GIB"
SHARED_GPU_KV_GIB = "4"


def engine_env(shared_gpu: bool, env: dict | None = None) -> dict:
    """The environment of an engine subprocess: ``env`` (default ``os.environ``), with a fixed KV
    size (``SHARED_GPU_KV_GIB`` unless one is set) when other processes use the GPU beside it."""
    env = dict(os.environ if env is None else env)
    if shared_gpu and not env.get(ENGINE_KV_GIB_ENV, "").strip():
        env[ENGINE_KV_GIB_ENV] = SHARED_GPU_KV_GIB
    return env


@dataclasses.dataclass(frozen=True)
class EngineCase:
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


_ACCEPT = (("enable_ihc", False),)  # the edited target needs a plain residual stream (acceptance doc)

ENGINE_CASES: dict[str, EngineCase] = {c.id: c for c in (
    # index sharing: step 0 runs the indexer, steps 1..K-1 reuse its rows compacted to the sampled rows
    EngineCase("engine-tiny-k3-share", overrides=(("index_share_for_mtp_iteration", True),), seed=31),
    # no sharing: every draft step runs the indexer
    EngineCase("engine-tiny-k2", num_speculative_tokens=2, seed=32, prompt_lens=(160, 9, 140)),
    # drafts accepted: near 100 % / 0 % / 1/3 / 2/3 per request in one batch (K = 3), index
    # sharing (compaction + skip-top-k at every step), one context longer than index_topk
    EngineCase("engine-accept-k3-share", overrides=_ACCEPT + (("index_share_for_mtp_iteration", True),), seed=33,
               target="acceptance", patterns=("accept", "reject", "alternate", "agree2"),
               prompt_lens=(200, 40, 150, 61),
               expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.1), ("alternate", 0.2, 0.5),
                             ("agree2", 0.5, 0.8))),
    # two MTP layers, K = 2, no index sharing: MultiModuleMTPSpeculator (layer k mod 2 at step k)
    EngineCase("engine-accept-k2-two-layers", overrides=_ACCEPT + (("num_nextn_predict_layers", 2),), seed=34,
               num_speculative_tokens=2, target="acceptance", patterns=("accept", "reject", "alternate"),
               prompt_lens=(180, 50, 90),
               # (reject: measured 4 of 54 drafts accepted, reference agreeing: the draft's
               # attention/MoE occasionally lands a disagree token on the right code)
               expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75))),
    # two MTP layers with index sharing: the speculator vLLM picks for it differs by release
    # (MultiModuleMTPSpeculator, or MTPSpeculator running layer 0 at every step); the report's
    # runner.mtp_layers_run says which, and the replay judges against that layer. Both layers
    # draft through the same acceptance code, so the planned rates hold either way.
    EngineCase("engine-accept-k2-two-layers-share",
               overrides=_ACCEPT + (("num_nextn_predict_layers", 2), ("index_share_for_mtp_iteration", True)),
               seed=35, num_speculative_tokens=2, target="acceptance", patterns=("accept", "reject", "alternate"),
               prompt_lens=(180, 50, 90),
               expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75)),
               upstream_gaps=(("MultiModule", "attn.topk rows are not the reference's (shared step 0 rows",
                               "MultiModuleMTPSpeculator does not implement index_share_for_mtp_iteration: its "
                               "steps >= 1 run their own indexer instead of reusing step 0's rows (later vLLM "
                               "picks MTPSpeculator for such a checkpoint: config/speculative.py "
                               "use_multi_module_mtp, 'TODO: Support index_share_for_mtp_iteration in "
                               "MultiModuleMTPSpeculator')"),)),
    # CUDA graphs as served: engine-accept-k3-share with vLLM's default compilation configuration.
    # 4 requests (a capture size: FULL draft-decode graphs without padding); the batch shrinks as
    # the near-100 % request finishes first, so later steps run 3 requests padded to 4
    EngineCase("engine-graphs-accept-k3-share", overrides=_ACCEPT + (("index_share_for_mtp_iteration", True),),
               seed=33, target="acceptance", patterns=("accept", "reject", "alternate", "agree2"),
               prompt_lens=(200, 40, 150, 61), graphs=True,
               expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.1), ("alternate", 0.2, 0.5),
                             ("agree2", 0.5, 0.8))),
    # 3 requests (not a capture size: every graph step runs padded rows), K = 2, no index sharing
    # (the indexer runs inside the decode graph), requests finishing at different steps
    EngineCase("engine-graphs-accept-k2-padded", overrides=_ACCEPT, seed=36, num_speculative_tokens=2,
               target="acceptance", patterns=("accept", "reject", "alternate"), prompt_lens=(170, 45, 133),
               graphs=True,
               expect_rates=(("accept", 0.9, 1.0), ("reject", 0.0, 0.15), ("alternate", 0.25, 0.75))),
)}
