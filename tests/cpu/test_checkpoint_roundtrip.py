"""Synthetic checkpoints load back to the seed's canonical weights, in every layout and quant.

bf16: bitwise equal to ``random_weights``. FP8: the tensors vLLM quantizes equal
q * s for (q, s) computed here independently from ``reference.fp8`` (block
amax / 448 rounded to a float32 scale, or a power of two for UE8M0), every
other tensor bitwise equal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.options import add_synth_arguments
from harness.checkpoint.synth import synth_command, synth_config, write_synthetic
from reference.config import MTPConfig
from reference.fp8 import dequantize_block, quantize_block, to_e4m3, ue8m0_decode
from reference.weights import random_weights

VOCAB = 256
SEED = 7
# what vLLM 0.33 holds in block FP8 in the MTP layer (the indexer wk is
# FP8 in the checkpoint and dequantized by vLLM while loading)
FP8_LEAVES = {"attn.q_a_proj", "attn.kv_a_proj_with_mqa", "attn.q_b_proj", "attn.kv_b_proj",
              "attn.o_proj", "indexer.wq_b", "indexer.wk",
              "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
              "mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}


def _expected_fp8(w: torch.Tensor, ue8m0: bool) -> torch.Tensor:
    q, s = quantize_block(w, (128, 128), ue8m0=ue8m0)
    if not ue8m0:  # the checkpoint stores float32 scales: q is taken against the stored scale
        s = s.float().double()
        full = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :w.shape[-2], :w.shape[-1]]
        q = to_e4m3(w / full)
    return dequantize_block(q, s, (128, 128))


def _expected(weights: dict, quant: str, bf16_wk: bool = False) -> dict:
    if quant == "bf16":
        return weights
    out = {}
    for k, v in weights.items():
        leaf = k.split(".", 2)[-1]
        q = k.startswith("layers.") and leaf in FP8_LEAVES and not (bf16_wk and leaf == "indexer.wk")
        out[k] = _expected_fp8(v, quant == "fp8-ue8m0") if q else v
    return out


@pytest.fixture(scope="module")
def seed_weights():
    hf = synth_config("tiny", vocab_size=VOCAB)
    cfg = MTPConfig.from_hf_dict(hf)
    return hf, cfg, random_weights(cfg, SEED)


@pytest.fixture(scope="module")
def seed_expected(seed_weights):
    """``_expected(seed weights, quant, bf16_wk)``, computed once per (quant, bf16_wk) for the module:
    the ~15 tests on the seed weights each re-quantized all of them (~0.13 s a call); a pure
    function of the same tensors, and the tests only read the dict it returns."""
    memo: dict = {}

    def get(quant: str, bf16_wk: bool = False) -> dict:
        if (quant, bf16_wk) not in memo:
            memo[quant, bf16_wk] = _expected(seed_weights[2], quant, bf16_wk)
        return memo[quant, bf16_wk]
    return get


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    bad = [k for k in want if got[k].dtype != torch.float64 or not torch.equal(got[k], want[k])]
    assert not bad, f"differ: {bad}"


@pytest.mark.parametrize("naming,experts,quant", list(itertools.product(
    ("mtp_layers", "layers"), ("split", "fused"), ("bf16", "fp8", "fp8-ue8m0"))))
def test_every_variant_loads_to_the_seed(tmp_path, seed_weights, seed_expected, naming, experts, quant):
    hf, cfg, w = seed_weights
    d = write_synthetic(tmp_path / "ckpt", hf, w, naming=naming, experts=experts, quant=quant, shards=3)
    loaded = load_checkpoint(d)
    assert loaded.cfg == cfg
    _assert_same(loaded.weights, seed_expected(quant))
    cfgj = json.loads((d / "config.json").read_text())
    assert cfgj["mtp_quant_algo"] == ("BF16" if quant == "bf16" else "FP8")
    if quant != "bf16":
        qc = cfgj["quantization_config"]
        assert qc["weight_block_size"] == [128, 128] and qc["activation_scheme"] == "dynamic"
        assert (qc.get("scale_fmt") == "ue8m0") == (quant == "fp8-ue8m0")
        prefix = "model.mtp_layers.0." if naming == "mtp_layers" else f"model.layers.{cfg.num_hidden_layers}."
        assert prefix + "self_attn.linear_gate" in qc["modules_to_not_convert"]
        assert set(loaded.fp8) == {k for k in w if k.split(".", 2)[-1] in FP8_LEAVES}
    else:
        assert "quantization_config" not in cfgj and not loaded.fp8
    # provenance: every canonical tensor names where it came from
    assert set(loaded.source) == set(w)
    prefix = "model.mtp_layers.0." if naming == "mtp_layers" else f"model.layers.{cfg.num_hidden_layers}."
    assert loaded.source["layers.0.eh_proj"] == [prefix + "eh_proj.weight"]


@pytest.mark.parametrize("scale_dtype,suffix", [("uint8", "scale"), ("e8m0", "weight_scale_inv"),
                                                ("float32", "scale"), ("auto", "scale")])
def test_ue8m0_scale_storages_agree(tmp_path, seed_weights, seed_expected, scale_dtype, suffix):
    hf, _, w = seed_weights
    d = write_synthetic(tmp_path / "c", hf, w, quant="fp8-ue8m0", scale_dtype=scale_dtype,
                        expert_scale_suffix=suffix)
    # uint8 on linear scales is what vLLM misreads: only loadable with strict_vllm=False
    loaded = load_checkpoint(d, strict_vllm=scale_dtype != "uint8")
    _assert_same(loaded.weights, seed_expected("fp8-ue8m0"))


def test_fused_and_split_scale_suffixes(tmp_path, seed_weights, seed_expected):
    hf, _, w = seed_weights
    for experts in ("split", "fused"):
        d = write_synthetic(tmp_path / experts, hf, w, experts=experts, quant="fp8", expert_scale_suffix="scale")
        loaded = load_checkpoint(d)
        _assert_same(loaded.weights, seed_expected("fp8"))
        assert any(n.endswith(".scale") for n in loaded.source["layers.0.mlp.experts.down_proj"])


def test_single_file_without_index(tmp_path, seed_weights, seed_expected):
    hf, _, w = seed_weights
    d = write_synthetic(tmp_path / "c", hf, w, quant="fp8", index=False)
    assert sorted(os.listdir(d)) == [".hyv4-harness-written.json", "config.json", "model.safetensors"]
    _assert_same(load_checkpoint(d).weights, seed_expected("fp8"))


def test_bf16_indexer_wk_in_fp8_checkpoint(tmp_path, seed_weights, seed_expected):
    hf, _, w = seed_weights
    d = write_synthetic(tmp_path / "c", hf, w, quant="fp8", indexer_wk_fp8=False)
    loaded = load_checkpoint(d)
    _assert_same(loaded.weights, seed_expected("fp8", bf16_wk=True))
    assert "layers.0.indexer.wk" not in loaded.fp8


def test_vllm_weights_round_the_fp8_wk_to_bf16(tmp_path, seed_weights):
    hf, _, w = seed_weights
    loaded = load_checkpoint(write_synthetic(tmp_path / "c", hf, w, quant="fp8"))
    v = loaded.vllm_weights()
    wk = loaded.weights["layers.0.indexer.wk"]
    assert torch.equal(v["layers.0.indexer.wk"], wk.float().bfloat16().double())
    assert all(torch.equal(v[k], loaded.weights[k]) for k in v if not k.endswith("indexer.wk"))


@pytest.mark.parametrize("switches", [
    dict(dense_mlp=True), dict(headwise_gate=True), dict(no_sink=True), dict(index_share=True),
    dict(mtp_layers=2), dict(mtp_layers=2, dense_mlp=True, headwise_gate=True, no_sink=True)])
@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_config_switches(tmp_path, switches, quant):
    hf = synth_config("tiny", vocab_size=VOCAB, **switches)
    cfg = MTPConfig.from_hf_dict(hf)
    w = random_weights(cfg, SEED)
    d = write_synthetic(tmp_path / "c", hf, w, quant=quant, experts="fused", shards=2)
    loaded = load_checkpoint(d)
    assert loaded.cfg == cfg
    _assert_same(loaded.weights, _expected(w, quant))


def test_two_mtp_layers_with_layers_naming_is_refused_strictly(tmp_path):
    from harness.checkpoint.errors import CheckpointError

    hf = synth_config("tiny", vocab_size=VOCAB, mtp_layers=2)
    cfg = MTPConfig.from_hf_dict(hf)
    w = random_weights(cfg, SEED)
    d = write_synthetic(tmp_path / "c", hf, w, naming="layers")
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\..*vLLM 0\.33 ignores"):
        load_checkpoint(d)
    _assert_same(load_checkpoint(d, strict_vllm=False).weights, w)


def test_backbone_tensors_are_never_opened(tmp_path, seed_weights, seed_expected):
    """Index entries for backbone tensors point at a file that does not exist: loading still works."""
    hf, _, w = seed_weights
    d = write_synthetic(tmp_path / "c", hf, w, quant="fp8", shards=2)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.layers.0.self_attn.o_proj.weight"] = "backbone-00001.safetensors"
    idx["weight_map"]["model.norm.weight"] = "backbone-00001.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    loaded = load_checkpoint(d)
    assert "backbone-00001.safetensors" not in loaded.files_read
    _assert_same(loaded.weights, seed_expected("fp8"))


def test_cli_writes_atomically_and_refuses_to_overwrite(tmp_path, capsys):
    p = argparse.ArgumentParser()
    add_synth_arguments(p)
    out = tmp_path / "ck"
    argv = [str(out), "--vocab-size", str(VOCAB), "--seed", str(SEED), "--quant", "fp8-ue8m0",
            "--experts", "fused", "--naming", "layers", "--shards", "2"]
    assert synth_command(p.parse_args(argv)) == 0
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no tmp dir left behind
    before = (out / "config.json").read_text()
    assert synth_command(p.parse_args(argv[:-2] + ["--shards", "1"])) == 2
    assert "not empty" in capsys.readouterr().err
    # two shards, the index, config.json and the harness's marker
    assert (out / "config.json").read_text() == before and len(os.listdir(out)) == 5
    assert synth_command(p.parse_args(argv[:-2] + ["--shards", "1", "--force"])) == 0
    assert sorted(os.listdir(tmp_path)) == ["ck"] and len(os.listdir(out)) == 4
    hf = synth_config("tiny", vocab_size=VOCAB)
    w = random_weights(MTPConfig.from_hf_dict(hf), SEED)
    _assert_same(load_checkpoint(out).weights, _expected(w, "fp8-ue8m0"))


def test_cut_real_case(tmp_path, seed_weights, seed_expected):
    from harness.checkpoint.loader import cut_real_case

    hf, _, w = seed_weights
    src = write_synthetic(tmp_path / "src", hf, w, quant="fp8-ue8m0", experts="fused", shards=2)
    small = cut_real_case(src, tmp_path / "small", 64)
    loaded = load_checkpoint(small)
    assert loaded.cfg.vocab_size == 64
    want = seed_expected("fp8-ue8m0")
    want = {k: (v[:64] if k in ("embed_tokens", "lm_head") else v) for k, v in want.items()}
    _assert_same(loaded.weights, want)


@given(seed=st.integers(0, 2**31 - 1), naming=st.sampled_from(["mtp_layers", "layers"]),
       experts=st.sampled_from(["split", "fused"]), quant=st.sampled_from(["bf16", "fp8", "fp8-ue8m0"]),
       shards=st.integers(1, 4))
def test_any_seed_any_layout_round_trips(tmp_path_factory, seed, naming, experts, quant, shards):
    hf = synth_config("tiny", vocab_size=128, n_routed_experts=4, num_experts_per_tok=2)
    cfg = MTPConfig.from_hf_dict(hf)
    w = random_weights(cfg, seed)
    d = write_synthetic(tmp_path_factory.mktemp("h") / "c", hf, w, naming=naming, experts=experts,
                        quant=quant, shards=shards)
    _assert_same(load_checkpoint(d).weights, _expected(w, quant))


@given(exp=st.lists(st.integers(-30, 20), min_size=1, max_size=16))
def test_ue8m0_scale_codecs_round_trip(exp):
    from harness.checkpoint.quant import decode_scale, encode_scale

    s = torch.exp2(torch.tensor(exp, dtype=torch.float64))
    for storage in ("uint8", "e8m0", "float32"):
        t = encode_scale(s, True, storage)
        assert torch.equal(decode_scale(t, True), s)
    assert torch.equal(ue8m0_decode(encode_scale(s, True, "uint8")), s)


def test_stored_tensors_are_the_files_tensors(tmp_path, seed_weights):
    from safetensors.torch import load_file

    hf, _, w = seed_weights
    d = write_synthetic(tmp_path / "c", hf, w, quant="fp8-ue8m0", experts="fused", expert_scale_suffix="scale")
    stored = load_checkpoint(d).stored_tensors()
    on_disk = load_file(str(d / "model-00001-of-00001.safetensors"))
    assert set(stored) == set(on_disk)
    for k, v in on_disk.items():
        assert stored[k].dtype == v.dtype and torch.equal(stored[k].view(torch.uint8), v.view(torch.uint8)), k
    assert stored["model.mtp_layers.0.mlp.experts.gate_up_proj.scale"].dtype == torch.uint8
