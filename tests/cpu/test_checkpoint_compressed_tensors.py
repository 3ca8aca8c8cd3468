"""compressed-tensors FP8 checkpoints (channel / block) and the reload cases' weight sets, on CPU.

synth -> config fields and tensors as compressed-tensors writes them (ignore list with exact names and
``re:`` patterns, ``weight_scale`` shapes and dtypes), the loader's exact dequantization and its
refusals (exit 2 naming the key or tensor), the plan's ignore matching checked against vLLM's own
``CompressedTensorsConfig`` + ``should_ignore_layer`` after HYV4MTP's own remap (which names the gap),
the post-load audit naming the gap, and the reload cases: set B differs from set A in every stored
tensor, and the stale-parameter comparison names what a reload left behind.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.quant import _QUANT_MODULES, CT_GAP, mtp_fp8_plan, quant_of_config
from harness.checkpoint.synth import checkpoint_tensors, synth_config, write_synthetic
from reference.config import MTPConfig
from reference.weights import random_weights

CHANNEL, BLOCK = "compressed-tensors-fp8", "compressed-tensors-fp8-block"
GATE = "model.mtp_layers.0.self_attn.linear_gate"

# vLLM's modules, imported by the one test that needs them (the MTP model pulls in most of vLLM)
VLLM_IN_PROCESS = ("test_plan_agrees_with_vllms_compressed_tensors_config",)

_W: dict = {}


def _weights(cfg: MTPConfig, seed: int = 0) -> dict:
    key = (repr(cfg), seed)
    if key not in _W:
        _W[key] = random_weights(cfg, seed)
    return {k: v.clone() for k, v in _W[key].items()}


def _write(tmp_path, quant=CHANNEL, style="regex", name="ckpt", dense=False, seed=0):
    hf = synth_config("tiny", dense_mlp=dense)
    w = _weights(MTPConfig.from_hf_dict(hf), seed)
    return write_synthetic(tmp_path / name, hf, w, quant=quant, index=False, ct_ignore_style=style), w


@pytest.mark.parametrize("quant", [CHANNEL, BLOCK])
@pytest.mark.parametrize("style", ["regex", "checkpoint-names"])
def test_synth_writes_compressed_tensors_as_it_is_laid_out(tmp_path, quant, style):
    path, _ = _write(tmp_path, quant, style)
    hf = json.loads((path / "config.json").read_text())
    qc = hf["quantization_config"]
    assert "mtp_quant_algo" not in hf and quant_of_config(hf) == quant  # the MTP layers inherit it
    assert (qc["quant_method"], qc["format"], qc["kv_cache_scheme"]) == ("compressed-tensors", "float-quantized", None)
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, "float", True, False)
    assert a["dynamic"] is True and a["type"] == "float"
    if quant == CHANNEL:
        assert (w["strategy"], w["block_structure"], a["strategy"]) == ("channel", None, "token")
    else:
        assert ((w["strategy"], w["block_structure"], a["strategy"], a["group_size"])
                == ("block", [128, 128], "group", 128))
    ignore = qc["ignore"]
    assert ignore[0] == "lm_head" and any(e.startswith("re:") for e in ignore)
    if style == "regex":
        assert r"re:.*self_attn\.linear_gate$" in ignore and not any("mtp_layers" in e for e in ignore)
    else:
        assert GATE in ignore and r"re:model\.mtp_layers\.0\.mlp\.experts\..*" in ignore
    t = load_file(str(path / "model.safetensors"))
    assert not any(n.endswith(("weight_scale_inv", "input_scale", ".scale")) for n in t)
    assert t[GATE + ".weight"].dtype == torch.bfloat16 and GATE + ".weight_scale" not in t
    q = t["model.mtp_layers.0.self_attn.q_b_proj.weight"]
    s = t["model.mtp_layers.0.self_attn.q_b_proj.weight_scale"]
    n, k = q.shape
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert tuple(s.shape) == ((n, 1) if quant == CHANNEL else (-(-n // 128), -(-k // 128)))
    ex = "model.mtp_layers.0.mlp.experts.0.down_proj"
    if style == "regex":  # routed experts FP8, one weight_scale per expert and projection
        assert t[ex + ".weight"].dtype == torch.float8_e4m3fn
        en, ek = t[ex + ".weight"].shape
        assert tuple(t[ex + ".weight_scale"].shape) == ((en, 1) if quant == CHANNEL else (-(-en // 128), -(-ek // 128)))
    else:  # ignored (by a checkpoint-named re: pattern): bf16, no scale
        assert t[ex + ".weight"].dtype == torch.bfloat16 and ex + ".weight_scale" not in t


@pytest.mark.parametrize("quant", [CHANNEL, BLOCK])
def test_reference_weights_are_the_exact_dequantized_checkpoint(tmp_path, quant):
    """Each FP8 weight the reference runs on is e4m3 x float32 scale in float64, the channel scale one
    multiplier per output row (no rounding anywhere), and within e4m3's half ulp of the drawn weight."""
    path, w = _write(tmp_path, quant)
    t = load_file(str(path / "model.safetensors"))
    loaded = load_checkpoint(path)
    q = t["model.mtp_layers.0.self_attn.o_proj.weight"].to(torch.float64)
    s = t["model.mtp_layers.0.self_attn.o_proj.weight_scale"].to(torch.float64)
    if quant == CHANNEL:
        want = q * s  # [n, k] * [n, 1]: row r scaled by s[r]
    else:
        want = q * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    assert torch.equal(loaded.weights["layers.0.attn.o_proj"], want)
    qe = t["model.mtp_layers.0.mlp.experts.3.up_proj.weight"].to(torch.float64)
    se = t["model.mtp_layers.0.mlp.experts.3.up_proj.weight_scale"].to(torch.float64)
    if quant == CHANNEL:
        assert torch.equal(loaded.weights["layers.0.mlp.experts.up_proj"][3], qe * se)
    assert loaded.fp8["layers.0.attn.o_proj"].block == ((1, q.shape[1]) if quant == CHANNEL else (128, 128))
    for name, v in loaded.weights.items():
        tol = (2 ** -4 * float(w[name].abs().max()) if name in loaded.fp8
               else 2 ** -8 * float(w[name].abs().max()) + 1e-30)
        assert float((v - w[name]).abs().max()) <= tol, name
    assert "layers.0.attn.linear_gate" not in loaded.fp8 and "layers.0.indexer.wk" not in loaded.fp8


def _edit_config(path, edit):
    hf = json.loads((path / "config.json").read_text())
    edit(hf["quantization_config"])
    (path / "config.json").write_text(json.dumps(hf))


@pytest.mark.parametrize("edit, key", [
    (lambda qc: qc.__setitem__("ignore", "lm_head"), "quantization_config.ignore 'lm_head': must be a list of strings"),
    (lambda qc: qc["ignore"].append(7), "quantization_config.ignore: entry 7 is an int"),
    (lambda qc: qc["ignore"].append("re:model.(mtp"), "quantization_config.ignore[5] 're:model.(mtp'"),
    # the q_a_proj shard of the fused fused_qkv_a_proj alone: vLLM refuses mixed shards
    (lambda qc: qc["ignore"].append(r"re:.*self_attn\.q_a_proj$"), "quantization_config.ignore: some but not all"),
    (lambda qc: qc["ignore"].append(r"re:.*experts\.\d+\.down_proj$"), "quantization_config.ignore: some but not all"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("strategy", "tensor"),
     "quantization_config.config_groups.group_0.weights.strategy"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].__setitem__("dynamic", False),
     "quantization_config.config_groups.group_0.input_activations.dynamic"),
    (lambda qc: qc.__setitem__("format", "naive-quantized"), "quantization_config.format"),
    (lambda qc: qc.__setitem__("kv_cache_scheme", {"num_bits": 8}), "quantization_config.kv_cache_scheme"),
])
def test_loader_refuses_bad_configs_naming_the_key(tmp_path, edit, key):
    from harness.cli import main

    path, _ = _write(tmp_path)
    _edit_config(path, edit)
    with pytest.raises(CheckpointError, match="config.json") as exc:
        load_checkpoint(path)
    assert key in str(exc.value), str(exc.value)
    assert main(["reference", str(path), "--out", str(tmp_path / "trace.safetensors")]) == 2


def test_loader_refuses_tensors_the_config_does_not_describe(tmp_path):
    path, _ = _write(tmp_path)
    t = load_file(str(path / "model.safetensors"))
    o_scale = "model.mtp_layers.0.self_attn.o_proj.weight_scale"
    expert_scale = "model.mtp_layers.0.mlp.experts.1.gate_proj.weight_scale"

    def renamed(name):  # a scale under the Fp8Config name: vLLM's compressed-tensors layers load weight_scale
        return lambda bad: bad.__setitem__(name + "_inv", bad.pop(name))

    edits = [  # (what the checkpoint gets wrong, the loader's line)
        # an ignored module stored FP8
        (lambda bad: bad.update({GATE + ".weight": t[GATE + ".weight"].to(torch.float8_e4m3fn),
                                 GATE + ".weight_scale": torch.ones(t[GATE + ".weight"].shape[0], 1)}),
         r"linear_gate\.weight: stored as float8_e4m3fn, but quantization_config\.ignore excludes it"),
        (renamed(o_scale), r"o_proj.weight_scale_inv: .*loads \.weight_scale"),
        (renamed(expert_scale), r"experts\.1\.gate_proj\.weight_scale_inv: .*weight_scale"),
        (lambda bad: bad.__setitem__(o_scale, torch.ones(1, 256)),  # a channel scale of the wrong shape
         r"o_proj\.weight_scale: scale shape \[1, 256\], expected \[256, 1\]"),
    ]
    for edit, line in edits:
        bad = dict(t)
        edit(bad)
        save_file(bad, str(path / "model.safetensors"))
        with pytest.raises(CheckpointError, match=line):
            load_checkpoint(path)


def test_fused_experts_are_refused_by_synth():
    hf = synth_config("tiny")
    with pytest.raises(ValueError, match="fused experts are not modelled"):
        checkpoint_tensors(hf, _weights(MTPConfig.from_hf_dict(hf)), quant=CHANNEL, experts="fused")


def _ct_hf(style: str, dense=False, quant=CHANNEL) -> tuple[dict, MTPConfig]:
    hf = synth_config("tiny", dense_mlp=dense)
    cfg = MTPConfig.from_hf_dict(hf)
    hf2, _ = checkpoint_tensors(hf, _weights(cfg), quant=quant, ct_ignore_style=style)
    return hf2, cfg


def test_plan_names_the_gap_only_for_checkpoint_named_entries():
    hf, cfg = _ct_hf("checkpoint-names")
    plan = mtp_fp8_plan(hf, cfg)
    gaps = {m for m, _ in _QUANT_MODULES.values() if plan.vllm_gap(f"model.layers.2.{m}")}
    assert gaps == {"self_attn.linear_gate", "mlp.experts"}
    assert CT_GAP in plan.vllm_gap("model.layers.2.self_attn.linear_gate")
    hf, cfg = _ct_hf("regex")
    plan = mtp_fp8_plan(hf, cfg)
    assert not any(plan.vllm_gap(f"model.layers.2.{m}") for m, _ in _QUANT_MODULES.values())
    assert plan.excluded_by("model.layers.2.self_attn.linear_gate") == r"re:.*self_attn\.linear_gate$"
    assert plan.excluded_by("model.layers.2.mlp.experts") is None and plan.is_quantized(0, "mlp.experts.up_proj")


@pytest.mark.parametrize("style", ["regex", "checkpoint-names"])
@pytest.mark.parametrize("dense", [False, True])
def test_plan_agrees_with_vllms_compressed_tensors_config(style, dense, gc_paused):
    """What vLLM builds, by its own code on CPU: ``CompressedTensorsConfig.from_config`` of the synthetic
    quantization_config, HYV4MTP's ``_create_mtp_quant_config`` + ``_remap_mtp_quant_exclusions``, then
    ``get_scheme_dict`` per draft prefix (the routed experts through the three unfused names its MoE
    method asks for). ``Fp8Plan.vllm_excluded_by`` must say the same for every governed module."""
    with gc_paused():
        mtp = pytest.importorskip("vllm.models.hy_v4.nvidia.mtp", reason="vLLM's HY V4 MTP module does not import here")
        ct = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    hf, cfg = _ct_hf(style, dense)
    qc = ct.CompressedTensorsConfig.from_config(json.loads(json.dumps(hf["quantization_config"])))
    qc = mtp._create_mtp_quant_config(types.SimpleNamespace(**hf), qc)
    qc = mtp._remap_mtp_quant_exclusions(qc, cfg.num_hidden_layers, cfg.num_mtp_layers)
    qc.packed_modules_mapping = mtp.HYV4MTP.packed_modules_mapping
    plan = mtp_fp8_plan(hf, cfg)
    layer = {leaf for leaf in _QUANT_MODULES
             if leaf in __import__("reference.weights", fromlist=["x"]).layer_shapes(cfg)}
    checked = 0
    for module in sorted({_QUANT_MODULES[leaf][0] for leaf in layer}):
        prefix = f"model.layers.{cfg.num_hidden_layers}.{module}"
        names = ([f"{prefix}.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")] if module == "mlp.experts"
                 else [prefix])
        dicts = [qc.get_scheme_dict(torch.nn.Linear(1, 1), n) for n in names]
        assert len({d is None for d in dicts}) == 1, (prefix, dicts)
        vllm_ignored = dicts[0] is None
        assert vllm_ignored == (plan.vllm_excluded_by(prefix) is not None), (style, prefix)
        if not vllm_ignored:
            assert str(dicts[0]["weights"].strategy).endswith("channel"), dicts[0]
        checked += 1
    assert checked >= 6
    # the exclusion attribute vLLM's remap reads is not compressed-tensors' one: the gap's cause
    assert "ignore" not in mtp._MTP_QUANT_EXCLUSION_ATTRS and qc.ignore == hf["quantization_config"]["ignore"]


def test_audit_names_the_gap_first_and_its_consequences_are_explained():
    from harness.production.module.audit import gap_modules, quant_method_problems, unexplained_by_gaps

    hf, cfg = _ct_hf("checkpoint-names")
    gate = "model.layers.2.mtp_block.self_attn.linear_gate"
    experts = "model.layers.2.mtp_block.mlp.experts.routed_experts"
    methods = {gate: "CompressedTensorsLinearMethod", experts: "CompressedTensorsW8A8Fp8MoEMethod",
               "model.layers.2.mtp_block.self_attn.o_proj": "CompressedTensorsLinearMethod",
               "model.layers.2.shared_head.head": "UnquantizedEmbeddingMethod"}
    problems = quant_method_problems(hf, methods)
    assert [p.split(": ", 1)[0] for p in problems] == [gate, experts]
    assert all(p.split(": ", 1)[1].startswith("vLLM gap: HYV4MTP._remap_mtp_quant_exclusions") for p in problems)
    assert gap_modules(problems) == [gate, experts]
    later = [f"{gate}.weight_scale: holds finfo(float32).min (scale sentinel never loaded)",
             "loader warning: HYV4 MTP draft model: 1 parameters received no checkpoint value: "
             f"{experts}.w13_weight_scale",
             "model.layers.2.mtp_block.self_attn.o_proj.weight_scale: contains NaN"]
    assert unexplained_by_gaps(problems + later) == [later[2]]  # a problem elsewhere is not hidden
    hf, _ = _ct_hf("regex")
    ok = {gate: "UnquantizedLinearMethod", experts: "CompressedTensorsW8A8Fp8MoEMethod"}
    assert quant_method_problems(hf, ok) == []
    assert "not matched by" in quant_method_problems(hf, {experts: "UnquantizedFusedMoEMethod"})[0]


# ---- reload: weight set B and the stale-parameter comparison -----------------------------------

@pytest.mark.parametrize("case_id", ["tiny-k2-reload", "tiny-k2-fp8-reload", "engine-reload-k2"])
def test_reload_set_b_differs_from_set_a_in_every_stored_tensor(case_id):
    """What a reload case feeds vLLM twice: every checkpoint tensor of set B (reload_seed) differs from
    set A's (seed), the sink, the expert bias and the FP8 scales included, so a part left stale is
    always visible as "still holds set A's value"."""
    from harness.case_registry import BY_ID

    case = BY_ID[case_id].spec
    hf = case.hf_config() if hasattr(case, "hf_config") else synth_config(case.preset, **dict(case.overrides))
    cfg = MTPConfig.from_hf_dict(hf)
    quant = getattr(case, "quant", "bf16")
    _, a = checkpoint_tensors(hf, _weights(cfg, case.seed), quant=quant)
    _, b = checkpoint_tensors(hf, _weights(cfg, case.reload_seed), quant=quant)
    assert sorted(a) == sorted(b)
    same = [n for n in a if torch.equal(a[n].view(torch.uint8) if a[n].dtype == torch.float8_e4m3fn else a[n],
                                        b[n].view(torch.uint8) if b[n].dtype == torch.float8_e4m3fn else b[n])]
    assert same == []
    names = " ".join(a)
    assert "learnable_sink_param" in names and "e_score_correction_bias" in names
    if quant != "bf16":
        assert sum(n.endswith("scale_inv") for n in a) > 10


def test_stale_parameters_names_what_the_reload_left_behind():
    from harness.production.module.reload import stale_parameters
    from harness.production.engine.reload import unchanged_since_set_a

    a = {"sink": torch.tensor([1.0, 2.0]), "w": torch.ones(2, 2, dtype=torch.bfloat16), "W_UV": torch.ones(3),
         "s": torch.tensor([0.5])}
    b = {"sink": torch.tensor([3.0, 4.0]), "w": torch.zeros(2, 2, dtype=torch.bfloat16), "W_UV": torch.full((3,), 2.0),
         "s": torch.tensor([0.25])}
    after = {"sink": a["sink"].clone(), "w": b["w"].clone(), "W_UV": b["W_UV"] * (1 + 2 ** -9),
             "s": torch.tensor([0.3]), "impl.sinks": a["sink"].clone()}
    problems, notes = stale_parameters(after, b, a, bound={"impl.sinks": "sink"})
    assert problems[0].startswith("impl.sinks: stale: still holds set A's value")
    assert problems[1].startswith("s: differs from a fresh load of set B")
    assert problems[2].startswith("sink: stale") and len(problems) == 3
    assert len(notes) == 1 and notes[0].startswith("W_UV: within")
    assert stale_parameters({k: v.clone() for k, v in b.items()}, b, a) == ([], [])
    assert stale_parameters({}, b, a)[0][0] == "W_UV: not in the model after the reload"
    assert unchanged_since_set_a(after, a) == ["sink: stale: still holds set A's value after the reload"]


def test_the_default_bisect_set_holds_a_case_of_each_deployed_configuration():
    """bisect-check's default set holds the cheapest case of each deployed configuration (FP8 KV cache,
    compressed-tensors, reload), judged against the reference only; --compressed-tensors / --reload add
    theirs to --case's cases; a baseline does not record them (never judged against one)."""
    import argparse

    from harness.commands.bisect_check import (DEFAULT_BISECT_CASES, REFERENCE_ONLY_BISECT_CASES, bisect_case_ids,
                                               side_by_side_ids)
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    base = bisect_case_ids(argparse.Namespace(case=None))
    assert set(REFERENCE_ONLY_BISECT_CASES) <= set(base)
    assert not set(REFERENCE_ONLY_BISECT_CASES) & set(DEFAULT_BISECT_CASES)
    kinds = {(gpu_cases[c].kv_cache_dtype, gpu_cases[c].quant, gpu_cases[c].reload_seed is not None)
             for c in REFERENCE_ONLY_BISECT_CASES}
    assert any(k[0] == "fp8" for k in kinds) and any(k[1].startswith("compressed-tensors") for k in kinds) \
        and any(k[2] for k in kinds), kinds
    assert bisect_case_ids(argparse.Namespace(case=None, compressed_tensors=True, reload=True)) == base
    assert bisect_case_ids(argparse.Namespace(case=["tiny-k1"], reload=True)) == ["tiny-k1", "tiny-k2-reload"]
    assert bisect_case_ids(argparse.Namespace(case=["tiny-k1"], compressed_tensors=True)) == \
        ["tiny-k1", "tiny-k2-ct-fp8-channel-long"]
    recorded = side_by_side_ids(argparse.Namespace(case=None, record_baseline="/tmp/b"))
    assert recorded == list(DEFAULT_BISECT_CASES)


# ---- vLLM on a faked CUDA platform (tests/cpu/_vllm_config_probe.py, conftest's vllm_probe) ----------
CT_IDS = ("tiny-k2-ct-fp8-channel-long", "tiny-k2-ct-fp8-block-long", "tiny-k2-ct-fp8-mtp-names")
PLANTED = "tiny-k2-ct-fp8-channel-long@ct-ignore-regex-dropped"
VLLM_PROBE = {"config": list(CT_IDS), "load": [*CT_IDS, PLANTED]}
_DRAFT_GATE = "model.layers.2.mtp_block.self_attn.linear_gate"
_DRAFT_EXPERTS = "model.layers.2.mtp_block.mlp.experts.routed_experts"



@pytest.mark.parametrize("case_id", CT_IDS)
def test_vllm_config_for_compressed_tensors_cases(vllm_probe, case_id):
    d = vllm_probe.answer("config", case_id)
    assert d["quantization"] == d["draft_quantization"] == "compressed-tensors"
    assert d["quant_config"] == "CompressedTensorsConfig" and d["draft_mtp_quant_algo"] is None


@pytest.mark.parametrize("case_id", CT_IDS[:2])
def test_vllm_load_weights_takes_the_compressed_tensors_checkpoint(vllm_probe, case_id):
    """HYV4MTP built by vLLM (CPU) from the regex-ignore checkpoints: every FP8 parameter dequantizes
    to the reference's weight exactly (channel: one scale per row), the gate and head are built
    unquantized, the rest with compressed-tensors methods, and the audit finds nothing."""
    from harness import case_registry
    gpu_cases = case_registry.specs(kind="module", without="probe")

    d = vllm_probe.answer("load", case_id)
    assert d["mismatches"] == [] and d["quant_problems"] == [], (d["mismatches"][:4], d["quant_problems"][:4])
    assert all(n.rsplit(".", 1)[1] in ("k_scale", "v_scale", "q_scale", "prob_scale")
               for n in d["unloaded"]), d["unloaded"]
    methods = d["quant_methods"]
    for m in gpu_cases[case_id].expect_unquantized:
        assert methods[m].startswith("Unquantized"), (m, methods[m])
    qb = "model.layers.2.mtp_block.self_attn.q_b_proj"
    assert methods[qb] == "CompressedTensorsLinearMethod" and d["dtypes"][qb + ".weight"] == "float8_e4m3fn"
    assert d["dtypes"][qb + ".weight_scale"] == "float32"
    assert methods[_DRAFT_EXPERTS].startswith("CompressedTensors"), methods[_DRAFT_EXPERTS]


def test_vllm_builds_the_checkpoint_named_ignores_quantized_and_the_audit_names_the_gap(vllm_probe):
    """The known gap on vLLM's own build: compressed-tensors' ignore is not remapped onto the draft
    prefixes, so the bf16 gate and routed experts get quantized methods whose scales no checkpoint
    value reaches; the audit names them first, as vLLM's gap, and explains their unloaded scales."""
    from harness.production.module.audit import unexplained_by_gaps

    d = vllm_probe.answer("load", "tiny-k2-ct-fp8-mtp-names")
    methods, problems = d["quant_methods"], d["quant_problems"]
    assert methods[_DRAFT_GATE] == "CompressedTensorsLinearMethod", methods[_DRAFT_GATE]
    assert not methods[_DRAFT_EXPERTS].startswith("Unquantized"), methods[_DRAFT_EXPERTS]
    assert [p.split(": ", 1)[0] for p in problems] == [_DRAFT_GATE, _DRAFT_EXPERTS]
    assert all(": vLLM gap: HYV4MTP._remap_mtp_quant_exclusions" in p for p in problems)
    assert _DRAFT_GATE + ".weight_scale" in d["unloaded"]
    unloaded = [f"{n}: received no checkpoint value" for n in d["unloaded"]
                if n.rsplit(".", 1)[1] not in ("k_scale", "v_scale", "q_scale", "prob_scale")]
    assert unloaded and unexplained_by_gaps(problems + unloaded) == []


def test_planted_regex_ignore_bug_builds_the_gate_fp8_and_the_audit_names_it(vllm_probe):
    """The planted bug ``ct-ignore-regex-dropped`` on vLLM's own build: with the ``re:`` entries of the
    ignore list unmatched, the bf16 gate is built FP8 and its scale never loaded; the audit's first and
    only problem names the gate and the ignore entry, as a load failure (a bad commit), not a vLLM gap."""
    from harness import mutants

    m = mutants.BY_NAME["ct-ignore-regex-dropped"]
    assert (m.case, m.component) == ("tiny-k2-ct-fp8-channel-long", "attn.gate") and m.build_patch is not None
    d = vllm_probe.answer("load", PLANTED)
    assert d["quant_methods"][_DRAFT_GATE] == "CompressedTensorsLinearMethod", d["quant_methods"][_DRAFT_GATE]
    assert [p.split(": ", 1)[0] for p in d["quant_problems"]] == [_DRAFT_GATE], d["quant_problems"]
    assert "quantization_config.ignore excludes it" in d["quant_problems"][0]
    assert "vLLM gap" not in d["quant_problems"][0]
    assert _DRAFT_GATE + ".weight_scale" in d["unloaded"]


def test_synth_command_writes_set_a_and_set_b_and_refuses_fused_experts(tmp_path, capsys):
    """``synth --quant compressed-tensors-fp8``: two seeds of one config are a reload case's sets A and B
    (every stored tensor differs); fused experts are bad input (exit 2, one line naming the flags)."""
    from harness.cli import main

    for seed in (0, 1):
        assert main(["synth", str(tmp_path / f"set{seed}"), "--quant", CHANNEL, "--ct-ignore", "checkpoint-names",
                     "--seed", str(seed), "--no-index"]) == 0
    a, b = (load_file(str(tmp_path / f"set{s}" / "model.safetensors")) for s in (0, 1))
    assert sorted(a) == sorted(b) and not any(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    assert json.loads((tmp_path / "set0" / "config.json").read_text())["quantization_config"]["ignore"][1] == GATE
    capsys.readouterr()
    assert main(["synth", str(tmp_path / "fused"), "--quant", BLOCK, "--experts", "fused"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experts fused" in err[0], err


def test_case_records_round_trip_and_the_gap_is_matched_on_the_first_problem():
    """A saved report's case dict comes back as the case (nested upstream_gaps, reload_seed), a reload
    case's saved trace is judged as set B, and ``upstream_gap_of`` reads only the first problem."""
    import dataclasses

    from harness import case_registry
    from harness.production.case_inputs import _case_from_dict, reload_set_b
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.module.side_by_side import upstream_gap_of

    for cid in ("tiny-k2-ct-fp8-mtp-names", "tiny-k2-fp8-reload"):
        case = gpu_cases[cid]
        assert _case_from_dict(json.loads(json.dumps(dataclasses.asdict(case)))) == case
    b = reload_set_b(gpu_cases["tiny-k2-fp8-reload"])
    assert (b.seed, b.reload_seed, b.quant) == (44, None, "fp8")
    with pytest.raises(ValueError, match="not a reload case"):
        reload_set_b(gpu_cases["tiny-k1"])
    gap_case = gpu_cases["tiny-k2-ct-fp8-mtp-names"]
    hf, _ = _ct_hf("checkpoint-names")
    from harness.production.module.audit import quant_method_problems
    problems = quant_method_problems(hf, {_DRAFT_GATE: "CompressedTensorsLinearMethod"})
    assert upstream_gap_of(gap_case, problems) == gap_case.upstream_gaps[0]
    assert upstream_gap_of(gap_case, ["x: contains NaN", *problems]) is None
