"""The config surface: every layer-kind / MLP-kind / sink / gate key is read as vLLM 0.33 reads it.

Two levels, both on CPU:
- kinds (hypothesis): ``reference.config.mtp_layer_kinds`` vs vLLM's own config
  loader (``harness.mutants.vllm_hf_config``: HYV4Config and transformers'
  layer-type checks) followed by the rules of vLLM's ``HYV4MultiTokenPredictorLayer``
  (``_extend_layer_types``) and ``HYV4MLAAttention`` (``_SPARSE_LAYER_TYPES``);
- construction: what ``MTPConfig.from_hf_dict`` builds vs what vLLM's HYV4MTP
  constructor builds for the same ``config.json`` (``_vllm_config_probe.py``'s build,
  a faked SM90 platform in a subprocess shared by the run, conftest.py; no kernel runs): attention kind,
  indexer, whether the sink reaches the attention impl, MLP kind, shared
  experts, gate width, SwiGLU clamp, RoPE class / rotary_dim / magnitude.
The RoPE numbers themselves are compared in test_reference_vs_vllm_pure.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.mutants import vllm_hf_config
from harness.presets import preset
from reference import ConfigError, MTPConfig, moe, rope
from reference.config import ROPE_TYPES, mtp_layer_kinds

# vLLM is imported by the first test that reads it in process, not at collection (every xdist worker
# collects the whole suite; `import vllm` costs ~5 s of CPU). Where it is missing, that test skips
# (_vllm) and the probe's readers skip (conftest.py's vllm_probe), as the module-level importorskip did.
# VLLM_IN_PROCESS: tests/cpu/conftest.py runs this test in the worker that imports vLLM anyway.
VLLM_IN_PROCESS = {"test_layer_kinds_read_as_vllm"}


@pytest.fixture(scope="module")
def _vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed")

def _hf(**over) -> dict:
    hf = preset("tiny")
    for key, value in over.items():
        if value is None:
            hf.pop(key, None)
        else:
            hf[key] = value
    return hf


def _vllm_kinds(hf: dict) -> list[tuple[bool, bool]]:
    """(sparse attention, MoE) per MTP layer, by vLLM's own config loader and layer rules."""
    from vllm.models.hy_v4.nvidia.attention import _SPARSE_LAYER_TYPES
    from vllm.models.hy_v4.nvidia.mtp import _extend_layer_types

    vc = vllm_hf_config(hf)
    n = vc.num_hidden_layers
    kinds = []
    for idx in range(n, n + max(getattr(vc, "num_nextn_predict_layers", 1), 1)):
        lt = _extend_layer_types(getattr(vc, "layer_types", None), idx, "full_attention")
        mlt = _extend_layer_types(getattr(vc, "mlp_layer_types", None), idx, "sparse")
        sparse = (hasattr(vc, "index_topk") and lt is not None and idx < len(lt)
                  and lt[idx] in _SPARSE_LAYER_TYPES)
        kinds.append((bool(sparse), mlt[idx] != "dense"))
    return kinds


_ATTN = ["full_attention", "deepseek_sparse_attention", "sparse", "sparse_attention", "indexed_attention",
         "sliding_attention", "moe", "foo"]
_MLP = ["dense", "sparse", "moe", "x"]


@given(layer_types=st.none() | st.lists(st.sampled_from(_ATTN), min_size=2, max_size=3),
       mlp_layer_types=st.none() | st.lists(st.sampled_from(_MLP), min_size=1, max_size=4),
       nextn=st.integers(1, 3), sink=st.booleans())
@pytest.mark.usefixtures("_vllm")
def test_layer_kinds_read_as_vllm(layer_types, mlp_layer_types, nextn, sink):
    hf = _hf(layer_types=layer_types, mlp_layer_types=mlp_layer_types, num_nextn_predict_layers=nextn,
             learnable_sink=sink)
    try:
        want = _vllm_kinds(hf)
    except Exception:  # noqa: BLE001 (vLLM refuses the config)
        with pytest.raises(ConfigError):
            mtp_layer_kinds(hf)
        return
    assert mtp_layer_kinds(hf) == want
    if len(set(want)) > 1:
        with pytest.raises(ConfigError, match="different kinds"):
            MTPConfig.from_hf_dict(hf)
        return
    cfg = MTPConfig.from_hf_dict(hf)
    assert (cfg.attention_sparse, cfg.mlp_moe) == want[0]
    assert cfg.sink_applied == (sink and want[0][0])


# One config.json per row: (what it exercises, overrides of the tiny preset).
CONSTRUCTOR_CASES = [
    ("sparse attention, sink, MoE", {}),
    ("no layer_types: dense attention; the sink is loaded, not applied", {"layer_types": None}),
    ("dense attention, no sink", {"layer_types": ["full_attention"] * 2, "learnable_sink": False}),
    ("MLP kind 'moe' is MoE (anything but 'dense')", {"layer_types": None, "mlp_layer_types": ["dense", "moe"]}),
    ("MTP layers of different kinds: refused by the reference",
     {"layer_types": None, "mlp_layer_types": ["dense", "dense", "dense", "sparse"], "num_nextn_predict_layers": 2}),
    ("two sparse MTP layers, both DSA spellings", {"layer_types": ["sparse", "sparse_attention"],
                                                  "num_nextn_predict_layers": 2}),
    ("dense MLP", {"mlp_layer_types": ["dense", "dense"]}),
    ("gating_type unread without gated_mla", {"gated_mla": False, "gating_type": "foo"}),
    ("headwise gate", {"gating_type": "headwise"}),
    ("swiglu_limit 0.0: no clamp", {"swiglu_limit": 0.0}),
    ("swiglu_limit -1.0: no clamp", {"swiglu_limit": -1.0}),
    ("swiglu_limit 5.5", {"swiglu_limit": 5.5}),
    ("hidden_act gelu with a dense MLP: vLLM refuses", {"hidden_act": "gelu", "mlp_layer_types": ["dense", "dense"]}),
    ("hidden_act gelu, MoE without shared experts: unread", {"hidden_act": "gelu", "n_shared_experts": 0}),
    ("yarn attention_factor, partial rotary", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "attention_factor": 1.3,
        "partial_rotary_factor": 0.5}}),
    ("deepseek_yarn, rope_dim, attn_factor unread", {"rope_parameters": {
        "rope_type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
        "mscale": 1.0, "mscale_all_dim": 0.707, "rope_dim": 32, "attn_factor": 1.5}}),
]


# what vLLM's HYV4MTP constructor builds per config: one line per row, from the run's one vLLM probe
# process (conftest.py's vllm_probe fixture)
VLLM_PROBE = {"build": [_hf(**over) for _, over in CONSTRUCTOR_CASES]}


@pytest.fixture(scope="module")
def built(vllm_probe):
    return [vllm_probe.build(hf) for hf in VLLM_PROBE["build"]]


@pytest.mark.parametrize("row", range(len(CONSTRUCTOR_CASES)), ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_reference_builds_what_vllm_builds(built, row):
    hf = _hf(**CONSTRUCTOR_CASES[row][1])
    got = built[row]
    try:
        cfg = MTPConfig.from_hf_dict(hf)
    except ConfigError as exc:
        # vLLM refuses too, or the reference says what it does not model
        if "error" in got:
            return
        if "different kinds" in str(exc):
            kinds = {(v["sparse"], v["moe"]) for v in got["layers"].values()}
            assert len(kinds) > 1, got
            return
        assert "not modelled" in str(exc), (str(exc), got)
        return
    assert "error" not in got, f"vLLM refuses what the reference accepts: {got['error']}"
    for idx, layer in got["layers"].items():
        want = {
            "sparse": cfg.attention_sparse, "indexer": cfg.attention_sparse, "sink": cfg.sink_applied,
            "sink_param": cfg.learnable_sink, "moe": cfg.mlp_moe,
            "shared": cfg.mlp_moe and cfg.n_shared_experts > 0,
            "gate": cfg.gate_size_per_head if cfg.gated_mla else None,
            "swiglu_limit": moe.clamp_limit(cfg) if cfg.mlp_moe else None,
            "rope": [ROPE_TYPES[cfg.rope.rope_type], cfg.rotary_dim, pytest.approx(rope.mscale(cfg.rope), rel=1e-12)],
        }
        assert layer == want, f"MTP layer {idx}"


def test_the_probe_inspected_both_model_classes_on_its_own_cache_root(vllm_probe, built):
    """The probe ran vLLM's model-class inspection for the target and the draft in its own
    process (``harness.ci_speed.model_info_prefetch.inspect_in_this_process``) into the run's own vLLM cache
    (never the user's): vLLM's cache files for both are there once the probe has answered."""
    names = sorted(p.name for p in (vllm_probe.dir / "vllm-cache" / "modelinfos").glob("*.json"))
    assert len(names) == 2 and any("HYV4MTP" in n for n in names) and any("HYV4ForCausalLM" in n for n in names), names
