"""The case registry (``harness.case_registry``): every list of cases is a view of it, pinned here
with its ids and order (reports, goldens and test ids depend on both); every case id is unique
across kinds and every role and kind is a known one."""

from __future__ import annotations

import dataclasses

from harness import case_registry as reg

GPU = ("tiny-k1", "tiny-k3-ragged", "tiny-k2-fused-layers", "tiny-k2-clamp-headwise", "tiny-k2-nosink",
       "tiny-k3-share", "tiny-k2-long", "tiny-k2-long-prefill", "tiny-k3-long-share", "tiny-k2-topk512",
       "tiny-k2-small-preset", "tiny-k2-dense-mlp", "tiny-k2-headwise", "tiny-k2-yarn", "tiny-k2-two-mtp-layers",
       "tiny-k3-batch8", "real-dims-k2", "tiny-k2-fp8-split-long", "tiny-k2-fp8-ue8m0-fused-scale-long",
       "tiny-k2-modelopt-pb-long", "tiny-k2-modelopt-pb-dense", "tiny-k2-modelopt-layer-bf16-dense",
       "tiny-k2-long-fp8kv", "tiny-k2-ct-fp8-channel-long", "tiny-k2-ct-fp8-block-long", "tiny-k2-ct-fp8-mtp-names",
       "tiny-k2-reload", "tiny-k2-fp8-reload")
BISECT = ("tiny-k3-share", "tiny-k2-long", "tiny-k2-clamp-headwise", "tiny-k2-fp8-ue8m0-fused-scale-long")
ENGINE = ("engine-tiny-k3-share", "engine-tiny-k2", "engine-accept-k3-share", "engine-accept-k2-two-layers",
          "engine-accept-k2-two-layers-share", "engine-graphs-accept-k3-share", "engine-graphs-accept-k3-noshare",
          "engine-accept-k3-noshare", "engine-graphs-accept-k2-padded",
          "engine-accept-k3-share-fp8kv", "engine-graphs-accept-k2-padded-fp8kv", "engine-reload-k2",
          "engine-graphs-reload-k2")
FP8_KV = ("tiny-k2-long-fp8kv", "engine-accept-k3-share-fp8kv", "engine-graphs-accept-k2-padded-fp8kv")

def test_every_derived_list_keeps_its_ids_and_order():
    from harness import cases, golden_check
    from harness.commands import bisect_check
    from harness.production import cases as prod
    from harness.production.engine import cases as eng
    from harness.goldens import production as production_goldens

    reference = ("tiny-moe-sink-elementwise", "tiny-dense-headwise-nosink", "tiny-share-indexer")
    assert tuple(cases.CASES) == reference
    assert cases.GOLDEN_CASES == golden_check.GOLDEN_CASES == reference
    assert tuple(prod.GPU_CASES) == GPU
    assert tuple(prod.PROBE_CASES) == ("probe-topk4", "probe-two-mtp-layers-naming")
    assert prod.BISECT_CASES == bisect_check.DEFAULT_BISECT_CASES == BISECT
    assert production_goldens.GOLDEN_CASES == BISECT  # the goldens' set is the bisect's (no case judged by one only)
    assert prod.FP8_CASE_IDS == ("tiny-k2-fp8-split-long", "tiny-k2-fp8-ue8m0-fused-scale-long")
    assert prod.MODELOPT_CASE_IDS == ("tiny-k2-modelopt-pb-long", "tiny-k2-modelopt-pb-dense",
                                      "tiny-k2-modelopt-layer-bf16-dense")
    assert prod.CT_CASE_IDS == ("tiny-k2-ct-fp8-channel-long", "tiny-k2-ct-fp8-block-long", "tiny-k2-ct-fp8-mtp-names")
    assert prod.RELOAD_CASE_IDS == ("tiny-k2-reload", "tiny-k2-fp8-reload")
    assert tuple(eng.RELOAD_ENGINE_CASES) == ("engine-reload-k2", "engine-graphs-reload-k2")
    assert tuple(eng.ENGINE_CASES) == ENGINE
    assert reg.ids(role="fp8-kv") == FP8_KV
    assert bisect_check.DEFAULT_BISECT_ENGINE_CASES == ("engine-accept-k3-share", "engine-accept-k2-two-layers")
    assert bisect_check.GRAPH_BISECT_ENGINE_CASES == ("engine-graphs-accept-k3-share", "engine-graphs-accept-k3-noshare")
    assert bisect_check.CT_BISECT_CASES == ("tiny-k2-ct-fp8-channel-long",)
    assert bisect_check.RELOAD_BISECT_CASES == ("tiny-k2-reload",)
    assert bisect_check.REFERENCE_ONLY_BISECT_CASES == ("tiny-k2-long-fp8kv", "tiny-k2-ct-fp8-channel-long", "tiny-k2-reload")
    # the registry lists every case once: the reference, module (GPU then probe) and engine cases
    assert reg.ids() == reference + GPU + tuple(prod.PROBE_CASES) + ENGINE


def test_ids_are_unique_across_kinds_and_roles_and_kinds_are_known():
    all_ids = [r.id for r in reg.REGISTRY]
    assert len(all_ids) == len(set(all_ids)), sorted(i for i in all_ids if all_ids.count(i) > 1)
    spec_type = {"reference": reg.Case, "module": reg.GpuCase, "engine": reg.EngineCase}
    for r in reg.REGISTRY:
        assert r.kind in reg.KINDS and type(r.spec) is spec_type[r.kind], r.id
        assert isinstance(r.roles, frozenset) and r.roles <= set(reg.ROLES), (r.id, r.roles)
        assert {role for role, _ in r.order} <= r.roles, r.id
    used = set().union(*(r.roles for r in reg.REGISTRY))
    assert used == set(reg.ROLES), f"roles no case has: {set(reg.ROLES) - used}"


def test_role_lists_state_what_their_cases_are():
    for r in reg.records(role="fp8"):
        assert r.spec.quant in ("fp8", "fp8-ue8m0"), r.id
    # (a reload case of an FP8 checkpoint is in role "reload", not "fp8")
    assert reg.ids(role="fp8") == tuple(r.id for r in reg.records(kind="module") if r.spec.quant in ("fp8", "fp8-ue8m0")
                                        and r.spec.reload_seed is None)
    assert reg.ids(role="compressed-tensors") == tuple(r.id for r in reg.records(kind="module")
                                                       if r.spec.quant.startswith("compressed-tensors"))
    assert reg.ids(role="reload") == tuple(r.id for r in reg.REGISTRY if getattr(r.spec, "reload_seed", None) is not None)
    # a known vLLM gap is declared only where the case exists to show it
    assert [r.id for r in reg.REGISTRY if getattr(r.spec, "upstream_gaps", ()) and r.kind == "module"] == [
        "tiny-k2-ct-fp8-mtp-names"]
    assert reg.ids(role="modelopt") == tuple(r.id for r in reg.records(kind="module")
                                             if r.spec.quant == "modelopt-fp8-pb")
    assert all(r.spec.graphs for r in reg.records(role="graph-bisect"))
    assert not any(r.spec.graphs for r in reg.records(role="bisect", kind="engine"))
    assert reg.ids(role="golden", kind="module") == reg.ids(role="bisect", kind="module")
    # fp8-kv: exactly the cases served with an FP8 KV cache, module and engine (eager and CUDA graphs)
    assert reg.ids(role="fp8-kv") == tuple(r.id for r in reg.REGISTRY if getattr(r.spec, "kv_cache_dtype", "auto") != "auto")
    assert {r.kind for r in reg.records(role="fp8-kv")} == {"module", "engine"}
    assert {r.spec.graphs for r in reg.records(role="fp8-kv", kind="engine")} == {False, True}
    for r in reg.records(role="fp8-kv", kind="module"):  # contexts longer than index_topk (128)
        assert r.spec.tokens > 128, r.id


def test_unknown_role_or_kind_is_refused_and_specs_are_the_records():
    import pytest

    with pytest.raises(KeyError):
        reg.ids(role="no-such-role")
    with pytest.raises(KeyError):
        reg.ids(kind="no-such-kind")
    assert all(dataclasses.is_dataclass(s) for s in reg.specs().values())
    assert reg.BY_ID["tiny-k3-share"].spec is reg.specs(kind="module")["tiny-k3-share"]


def test_case_inputs_are_built_once_and_equal_the_cached_ones(tmp_path):
    """``build_inputs`` gives what ``case_inputs`` gives (bitwise) plus the config and first step;
    a checkpoint directory's already loaded checkpoint is used as given, not read again."""
    import torch

    import reference as R
    from harness.checkpoint.loader import load_checkpoint
    from harness.checkpoint.synth import write_synthetic
    from harness.production.cases import GPU_CASES, GpuCase, build_inputs, case_inputs

    case = GPU_CASES["tiny-k1"]
    inputs = build_inputs(case)
    hf, ckpt, weights = case_inputs(case)
    assert inputs.hf_config == hf and inputs.config == R.MTPConfig.from_hf_dict(hf)
    for mine, theirs in ((inputs.checkpoint, ckpt), (inputs.weights, weights)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    first = R.make_case(inputs.config, case.seed, case.requests, case.tokens)
    assert all(torch.equal(getattr(inputs.first, f), getattr(first, f)) for f in ("input_ids", "positions", "hidden"))

    path = write_synthetic(str(tmp_path / "ckpt"), hf, weights)
    loaded = load_checkpoint(path)
    on_disk = GpuCase("ckpt-test", ckpt_dir=path, requests=2, tokens=16)
    given = build_inputs(on_disk, loaded=loaded)
    assert given.hf_config is loaded.hf_config
    assert given.config == R.MTPConfig.from_hf_dict(loaded.hf_config)
