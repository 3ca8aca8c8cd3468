"""Bad checkpoints: each is refused with a CheckpointError naming the file, the tensor and the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.synth import synth_config, write_synthetic, write_tensors
from reference.config import MTPConfig
from reference.weights import random_weights

P = "model.mtp_layers.0."
SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    hf = synth_config("tiny", vocab_size=128)
    w = random_weights(MTPConfig.from_hf_dict(hf), 3)
    out = {}
    for quant in ("bf16", "fp8", "fp8-ue8m0"):
        for experts in ("split", "fused"):
            d = write_synthetic(root / f"{quant}-{experts}", hf, w, quant=quant, experts=experts,
                                expert_scale_suffix="scale" if quant == "fp8-ue8m0" else "weight_scale_inv")
            out[quant, experts] = d
    return out


def _variant(tmp_path, base, mutate=None, config=None, name="bad"):
    """A copy of ``base`` with its tensors passed through ``mutate`` and config through ``config``."""
    hf = json.loads((base / "config.json").read_text())
    tensors = load_file(str(base / SHARD))
    if mutate:
        mutate(tensors)
    if config:
        config(hf)
    return write_tensors(tmp_path / name, hf, tensors)


def _err(d, **kw) -> CheckpointError:
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(d, **kw)
    return ei.value


def _check(e: CheckpointError, file_end: str | None, tensor: str | None, *problem: str) -> None:
    msg = str(e)
    if file_end is not None:
        assert e.file is not None and e.file.endswith(file_end), msg
        assert e.file in msg
    if tensor is not None:
        assert e.tensor == tensor and tensor in msg, msg
    for p in problem:
        assert p in msg, msg


def test_base_checkpoints_load(bases):
    for d in bases.values():
        load_checkpoint(d)


def test_missing_tensor(tmp_path, bases):
    d = _variant(tmp_path, bases["bf16", "split"], lambda t: t.pop(P + "self_attn.q_b_proj.weight"))
    _check(_err(d), INDEX, P + "self_attn.q_b_proj.weight", "missing", "layers.0.attn.q_b_proj")


def test_missing_expert(tmp_path, bases):
    d = _variant(tmp_path, bases["bf16", "split"], lambda t: t.pop(P + "mlp.experts.5.up_proj.weight"))
    _check(_err(d), INDEX, P + "mlp.experts.5.up_proj.weight", "missing")


def test_missing_fused_half(tmp_path, bases):
    d = _variant(tmp_path, bases["fp8", "fused"], lambda t: (t.pop(P + "mlp.experts.down_proj"),
                                                             t.pop(P + "mlp.experts.down_proj_scale_inv")))
    _check(_err(d), INDEX, P + "mlp.experts.down_proj", "missing")


def test_missing_scale(tmp_path, bases):
    d = _variant(tmp_path, bases["fp8", "split"], lambda t: t.pop(P + "self_attn.o_proj.weight_scale_inv"))
    _check(_err(d), INDEX, P + "self_attn.o_proj.weight_scale_inv", "missing", "needs its block scale")


def test_missing_expert_scale(tmp_path, bases):
    d = _variant(tmp_path, bases["fp8-ue8m0", "split"], lambda t: t.pop(P + "mlp.experts.2.down_proj.scale"))
    _check(_err(d), INDEX, P + "mlp.experts.2.down_proj.weight_scale_inv", "missing")


def test_extra_tensor(tmp_path, bases):
    def add(t):
        t[P + "self_attn.rotary_emb.inv_freq"] = torch.zeros(4)
    _check(_err(_variant(tmp_path, bases["bf16", "split"], add)), SHARD,
           P + "self_attn.rotary_emb.inv_freq", "unknown tensor", "misnamed or extra")


def test_misnamed_tensor_suggests_the_name(tmp_path, bases):
    def rename(t):
        t[P + "self_attn.q_a_prj.weight"] = t.pop(P + "self_attn.q_a_proj.weight")
    _check(_err(_variant(tmp_path, bases["bf16", "split"], rename)), SHARD, P + "self_attn.q_a_prj.weight",
           "misnamed", "did you mean self_attn.q_a_proj.weight")


def test_linear_scale_with_expert_style_name(tmp_path, bases):
    """vLLM renames '.scale' to '.weight_scale_inv' only for routed experts."""
    def rename(t):
        t[P + "self_attn.o_proj.scale"] = t.pop(P + "self_attn.o_proj.weight_scale_inv")
    _check(_err(_variant(tmp_path, bases["fp8", "split"], rename)), SHARD, P + "self_attn.o_proj.scale",
           "unknown tensor")


def test_extra_mtp_layer(tmp_path, bases):
    def add(t):
        t["model.mtp_layers.1.enorm.weight"] = t[P + "enorm.weight"].clone()
    _check(_err(_variant(tmp_path, bases["bf16", "split"], add)), SHARD, "model.mtp_layers.1.enorm.weight",
           "MTP layer 1", "num_nextn_predict_layers=1")


def test_expert_out_of_range(tmp_path, bases):
    def add(t):
        t[P + "mlp.experts.8.up_proj.weight"] = t[P + "mlp.experts.0.up_proj.weight"].clone()
    _check(_err(_variant(tmp_path, bases["bf16", "split"], add)), SHARD, P + "mlp.experts.8.up_proj.weight",
           "out of range", "n_routed_experts=8")


def test_duplicated_across_namings(tmp_path, bases):
    def dup(t):
        t["model.layers.2.hnorm.weight"] = t[P + "hnorm.weight"].clone()
    e = _err(_variant(tmp_path, bases["bf16", "split"], dup))
    _check(e, SHARD, None, "duplicated")
    assert {e.tensor, str(e).split("duplicated: ")[1].split(" ")[0]} == \
        {"model.layers.2.hnorm.weight", P + "hnorm.weight"}


def test_duplicated_split_and_fused_experts(tmp_path, bases):
    fused = load_file(str(bases["bf16", "fused"] / SHARD))

    def dup(t):
        t[P + "mlp.experts.down_proj"] = fused[P + "mlp.experts.down_proj"]
    _check(_err(_variant(tmp_path, bases["bf16", "split"], dup)), SHARD, P + "mlp.experts.down_proj",
           "duplicated", "both split")


def test_duplicated_key_in_index(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["bf16", "split"], d)
    text = (d / INDEX).read_text()
    key = f'"{P}enorm.weight": "{SHARD}"'
    assert key in text
    (d / INDEX).write_text(text.replace(key, key + ",\n    " + key, 1))
    _check(_err(d), INDEX, P + "enorm.weight", "listed twice")


def test_wrong_shape(tmp_path, bases):
    def bad(t):
        t[P + "eh_proj.weight"] = t[P + "eh_proj.weight"][:, :256].contiguous()
    _check(_err(_variant(tmp_path, bases["bf16", "split"], bad)), SHARD, P + "eh_proj.weight",
           "shape [256, 256], expected [256, 512]")


def test_wrong_fp8_shape(tmp_path, bases):
    def bad(t):
        t[P + "mlp.experts.1.gate_proj.weight"] = t[P + "mlp.experts.1.gate_proj.weight"][:64].contiguous()
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, P + "mlp.experts.1.gate_proj.weight",
           "shape [64, 256], expected [128, 256]")


def test_wrong_scale_shape(tmp_path, bases):
    def bad(t):
        t[P + "self_attn.kv_b_proj.weight_scale_inv"] = t[P + "self_attn.kv_b_proj.weight_scale_inv"][:5].clone()
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, P + "self_attn.kv_b_proj.weight_scale_inv",
           "scale shape [5, 4], expected [6, 4]")


def test_wrong_dtype(tmp_path, bases):
    def bad(t):
        t[P + "enorm.weight"] = t[P + "enorm.weight"].half()
    _check(_err(_variant(tmp_path, bases["bf16", "split"], bad)), SHARD, P + "enorm.weight",
           "dtype float16, expected bfloat16")


def test_integer_weight(tmp_path, bases):
    def bad(t):
        t[P + "mlp.gate.weight"] = torch.zeros(t[P + "mlp.gate.weight"].shape, dtype=torch.int32)
    _check(_err(_variant(tmp_path, bases["bf16", "split"], bad)), SHARD, P + "mlp.gate.weight",
           "dtype int32, expected float32 or bfloat16")


def test_bf16_where_vllm_expects_fp8(tmp_path, bases):
    def bad(t):
        t.pop(P + "self_attn.q_b_proj.weight_scale_inv")
        t[P + "self_attn.q_b_proj.weight"] = t[P + "self_attn.q_b_proj.weight"].to(torch.bfloat16)
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, P + "self_attn.q_b_proj.weight",
           "dtype bfloat16", "vLLM quantizes this module to FP8", "modules_to_not_convert")


def test_fp8_in_a_bf16_config(tmp_path, bases):
    fp8 = load_file(str(bases["fp8", "split"] / SHARD))

    def bad(t):
        for k in ("self_attn.o_proj.weight", "self_attn.o_proj.weight_scale_inv"):
            t[P + k] = fp8[P + k]
    _check(_err(_variant(tmp_path, bases["bf16", "split"], bad)), SHARD, P + "self_attn.o_proj.weight",
           "float8_e4m3fn", "unquantized", "mtp_quant_algo='BF16'")


def test_fp8_module_listed_as_not_converted(tmp_path, bases):
    """config.json says linear_gate stays bf16; q_b_proj listed too while stored FP8 is inconsistent."""
    def cfg(hf):
        hf["quantization_config"]["modules_to_not_convert"].append(P + "self_attn.q_b_proj")
    _check(_err(_variant(tmp_path, bases["fp8", "split"], config=cfg)), SHARD, P + "self_attn.q_b_proj.weight",
           "float8_e4m3fn", "modules_to_not_convert")


def test_fp8_eh_proj(tmp_path, bases):
    from harness.checkpoint.quant import quantize_weight

    def bad(t):
        q, s = quantize_weight(t[P + "eh_proj.weight"].double())
        t[P + "eh_proj.weight"], t[P + "eh_proj.weight_scale_inv"] = q, s.float()
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, P + "eh_proj.weight",
           "float8_e4m3fn", "vLLM never quantizes this module")


def test_scale_without_fp8_weight(tmp_path, bases):
    def bad(t):
        t[P + "self_attn.linear_gate.weight_scale_inv"] = torch.ones(4, 2)
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD,
           P + "self_attn.linear_gate.weight_scale_inv", "not FP8")


def test_mixed_fused_shards_in_exclusions(tmp_path, bases):
    def cfg(hf):
        hf["quantization_config"]["modules_to_not_convert"].append(P + "self_attn.q_a_proj")
    _check(_err(_variant(tmp_path, bases["fp8", "split"], config=cfg)), "config.json", None,
           "some but not all shards", "fused_qkv_a_proj")


@pytest.mark.parametrize("value,problem", [(float("inf"), "non-finite scale"), (float("nan"), "non-finite scale"),
                                           (0.0, "zero scale"), (-0.01, "negative scale")])
def test_bad_float_scales(tmp_path, bases, value, problem):
    name = P + "self_attn.indexer.wq_b.weight_scale_inv"

    def bad(t):
        t[name] = t[name].clone()
        t[name][3, 1] = value
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, name, problem)


def test_bad_fused_expert_scale(tmp_path, bases):
    name = P + "mlp.experts.gate_up_proj_scale_inv"

    def bad(t):
        t[name] = t[name].clone()
        t[name][7, 1, 0] = 0.0
    _check(_err(_variant(tmp_path, bases["fp8", "fused"], bad)), SHARD, name, "zero scale")


def test_ue8m0_byte_255(tmp_path, bases):
    name = P + "mlp.experts.3.gate_proj.scale"

    def bad(t):
        assert t[name].dtype == torch.uint8
        t[name] = t[name].clone()
        t[name][0, 0] = 255
    _check(_err(_variant(tmp_path, bases["fp8-ue8m0", "split"], bad)), SHARD, name, "UE8M0 byte 255")


def test_ue8m0_byte_255_in_e8m0_dtype(tmp_path, bases):
    name = P + "self_attn.q_a_proj.weight_scale_inv"

    def bad(t):
        b = t[name].float().log2().add(127).to(torch.uint8)
        b[1, 0] = 255
        t[name] = b.view(torch.float8_e8m0fnu)
    _check(_err(_variant(tmp_path, bases["fp8-ue8m0", "split"], bad)), SHARD, name, "UE8M0 byte 255")


def test_ue8m0_float_scale_not_power_of_two(tmp_path, bases):
    name = P + "self_attn.o_proj.weight_scale_inv"

    def bad(t):
        t[name] = t[name] * 1.5
    _check(_err(_variant(tmp_path, bases["fp8-ue8m0", "split"], bad)), SHARD, name, "not a power of two")


def test_uint8_bytes_in_a_linear_scale(tmp_path, bases):
    """vLLM copies uint8 numerically into the e8m0 linear scale: refused unless strict_vllm=False."""
    name = P + "self_attn.o_proj.weight_scale_inv"

    def bad(t):
        t[name] = (t[name].log2() + 127).to(torch.uint8)
    d = _variant(tmp_path, bases["fp8-ue8m0", "split"], bad)
    _check(_err(d), SHARD, name, "uint8 UE8M0 bytes", "copies numerically")
    good = load_checkpoint(bases["fp8-ue8m0", "split"])
    assert torch.equal(load_checkpoint(d, strict_vllm=False).weights["layers.0.attn.o_proj"],
                       good.weights["layers.0.attn.o_proj"])


def test_uint8_scale_without_ue8m0(tmp_path, bases):
    name = P + "mlp.experts.0.down_proj.weight_scale_inv"

    def bad(t):
        t[name] = torch.full(t[name].shape, 120, dtype=torch.uint8)
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, name, "uint8", "no scale_fmt ue8m0")


def test_bf16_scale(tmp_path, bases):
    name = P + "self_attn.q_b_proj.weight_scale_inv"

    def bad(t):
        t[name] = t[name].bfloat16()
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, name, "scale dtype bfloat16, expected float32")


def test_non_finite_weight(tmp_path, bases):
    name = P + "hnorm.weight"

    def bad(t):
        t[name] = t[name].clone()
        t[name][5] = float("nan")
    _check(_err(_variant(tmp_path, bases["bf16", "split"], bad)), SHARD, name, "non-finite values")


def test_e4m3_nan(tmp_path, bases):
    name = P + "mlp.shared_experts.up_proj.weight"

    def bad(t):
        b = t[name].view(torch.uint8).clone()
        b[0, 0] = 0x7F  # e4m3fn NaN
        t[name] = b.view(torch.float8_e4m3fn)
    _check(_err(_variant(tmp_path, bases["fp8", "split"], bad)), SHARD, name, "e4m3 NaN")


def test_truncated_shard(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["fp8", "split"], d)
    f = d / SHARD
    os.truncate(f, f.stat().st_size - 4096)
    e = _err(d)
    _check(e, SHARD, None, "truncated or corrupt")
    assert e.tensor is not None and e.tensor in str(e)


def test_corrupt_header(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["fp8", "split"], d)
    with open(d / SHARD, "r+b") as fh:
        fh.seek(8)
        fh.write(b"\x00garbage")
    _check(_err(d), SHARD, None, "not a readable safetensors file")


def test_corrupt_single_file(tmp_path, bases):
    hf = json.loads((bases["bf16", "split"] / "config.json").read_text())
    d = write_tensors(tmp_path / "c", hf, load_file(str(bases["bf16", "split"] / SHARD)), index=False)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    _check(_err(d), "model.safetensors", None, "not a readable safetensors file")


def test_index_points_to_missing_file(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["bf16", "split"], d)
    idx = json.loads((d / INDEX).read_text())
    idx["weight_map"][P + "final_layernorm.weight"] = "model-00009-of-00009.safetensors"
    (d / INDEX).write_text(json.dumps(idx))
    _check(_err(d), INDEX, P + "final_layernorm.weight", "model-00009-of-00009.safetensors", "does not exist")


def test_index_names_a_tensor_the_shard_lacks(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["bf16", "split"], d)
    idx = json.loads((d / INDEX).read_text())
    idx["weight_map"][P + "self_attn.indexer.k_norm.bias"] = SHARD
    idx["weight_map"][P + "enorm.weight"] = SHARD
    idx["weight_map"][P + "self_attn.kv_a_layernorm.weight"] = SHARD
    idx["weight_map"]["model.mtp_layers.0.self_attn.linear_gate.weight"] = SHARD
    hf = json.loads((d / "config.json").read_text())
    tensors = load_file(str(d / SHARD))
    tensors.pop(P + "enorm.weight")
    from safetensors.torch import save_file
    save_file(tensors, str(d / SHARD))
    (d / INDEX).write_text(json.dumps(idx))
    del hf
    _check(_err(d), SHARD, P + "enorm.weight", "header does not hold it")


def test_index_without_weight_map(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["bf16", "split"], d)
    (d / INDEX).write_text(json.dumps({"metadata": {}}))
    _check(_err(d), INDEX, None, "no weight_map")


def test_no_tensors_file(tmp_path, bases):
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(bases["bf16", "split"] / "config.json", d)
    _check(_err(d), "c", None, "no model.safetensors.index.json and no model.safetensors")


def test_missing_or_broken_config(tmp_path, bases):
    d = tmp_path / "c"
    shutil.copytree(bases["bf16", "split"], d)
    (d / "config.json").write_text("{not json")
    _check(_err(d), "config.json", None, "cannot read config.json")
    (d / "config.json").unlink()
    _check(_err(d), "config.json", None, "missing")


def test_config_hidden_size_disagrees(tmp_path, bases):
    def cfg(hf):
        hf["hidden_size"] = 384
    _check(_err(_variant(tmp_path, bases["bf16", "split"], config=cfg)), SHARD, None,
           "expected", "from config.json")


def test_config_says_dense_mlp_but_checkpoint_has_moe(tmp_path, bases):
    def cfg(hf):
        hf["mlp_layer_types"] = ["dense"] * hf["num_hidden_layers"]
    e = _err(_variant(tmp_path, bases["bf16", "split"], config=cfg))
    _check(e, SHARD, None, "extra", "mlp dense")
    assert e.tensor.startswith(P + "mlp.")


def test_config_says_no_sink_but_checkpoint_has_one(tmp_path, bases):
    def cfg(hf):
        hf["learnable_sink"] = False
    _check(_err(_variant(tmp_path, bases["bf16", "split"], config=cfg)), SHARD,
           P + "self_attn.learnable_sink_param", "extra", "learnable_sink=False")


def test_config_the_reference_cannot_run(tmp_path, bases):
    def cfg(hf):
        hf["index_head_dim"] = 96
    _check(_err(_variant(tmp_path, bases["bf16", "split"], config=cfg)), "config.json", None,
           "config the reference cannot run")


def test_unknown_mtp_quant_algo(tmp_path, bases):
    def cfg(hf):
        hf["mtp_quant_algo"] = "NVFP4"
    _check(_err(_variant(tmp_path, bases["bf16", "split"], config=cfg)), "config.json", None, "NVFP4")


def test_synth_refuses_a_non_empty_directory(tmp_path, bases):
    hf = synth_config("tiny", vocab_size=128)
    w = random_weights(MTPConfig.from_hf_dict(hf), 3)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        write_synthetic(tmp_path / "x", hf, w)
    assert os.listdir(tmp_path / "x") == ["keep"] and sorted(os.listdir(tmp_path)) == ["x"]
