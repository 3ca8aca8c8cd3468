"""Whole-step and multi-step properties of the reference."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.presets import preset
from reference import (EXACT, PRODUCTION, DraftCache, MTPConfig, UnwrittenKVError, compact_topk, draft,
                       make_case, random_weights)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny(**over) -> MTPConfig:
    base = dict(vocab_size=256, index_topk=4)
    base.update(over)
    return MTPConfig.from_hf_dict(preset("tiny", **base))


def test_reference_never_imports_vllm():
    for path in (ROOT / "reference").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n == "vllm" or n.startswith("vllm.") for n in names), f"{path.name} imports {names}"


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("moe_mode", ["tp", "ep"])
def test_tp_sharded_equals_unsharded(t, moe_mode):
    cfg = tiny()
    w = random_weights(cfg, 5)
    first = make_case(cfg, 5, requests=2, tokens=6)
    one = draft(cfg, w, first, 2)
    many = draft(cfg, w, first, 2, tp=t, moe_mode=moe_mode)
    # The all-reduce sums t partial o_proj / down_proj outputs: float64 summation
    # order only (~1e-15 relative); 1e-9 leaves room for step 1 inheriting it.
    for k in range(2):
        for name, v in one.traces[k].items():
            torch.testing.assert_close(many.traces[k][name], v, rtol=1e-9, atol=1e-9, msg=f"step{k}.{name}")


@given(st.integers(0, 1000))
def test_tp8_equals_unsharded_on_eight_heads(seed):
    cfg = tiny(num_attention_heads=8, n_routed_experts=8, moe_intermediate_size=128)
    w = random_weights(cfg, seed)
    first = make_case(cfg, seed, requests=1, tokens=3)
    a = draft(cfg, w, first, 1).traces[0]
    b = draft(cfg, w, first, 1, tp=8).traces[0]
    # float64 summation order of the 8 partial sums, as above
    for name in ("attn.core", "attn.out", "moe.routed", "mlp.out", "logits"):
        torch.testing.assert_close(b[name], a[name], rtol=1e-9, atol=1e-9)


def test_tp_refuses_indivisible_heads():
    cfg = tiny()
    with pytest.raises(ValueError, match="num_attention_heads"):
        draft(cfg, random_weights(cfg, 0), make_case(cfg, 0, 1, 2), 1, tp=3)


def test_dense_attention_applies_no_sink():
    """vLLM builds dense-attention MTP layers without the sink (no dense MLA backend on NVIDIA
    takes one; the weight is loaded, the bias disabled): the reference follows."""
    hf = preset("tiny", vocab_size=256, layer_types=None)
    with_sink, without = MTPConfig.from_hf_dict(hf), MTPConfig.from_hf_dict(dict(hf, learnable_sink=False))
    assert not with_sink.attention_sparse and with_sink.learnable_sink and not with_sink.sink_applied
    w = random_weights(with_sink, 5)
    # a sink that would matter
    w = {k: (torch.full_like(v, 3.0) if k.endswith("attn.sink") else v) for k, v in w.items()}
    first = make_case(with_sink, 5, requests=2, tokens=6)
    a = draft(with_sink, w, first, 2)
    b = draft(without, {k: v for k, v in w.items() if not k.endswith("attn.sink")}, first, 2)
    for k in range(2):
        for name in ("attn.core", "logits"):
            assert torch.equal(a.traces[k][name], b.traces[k][name])
    # while on a sparse layer the same sink moves attn.core
    sparse = tiny()
    ws = random_weights(sparse, 5)
    fs = make_case(sparse, 5, requests=2, tokens=6)
    ws_big = {k: (torch.full_like(v, 3.0) if k.endswith("attn.sink") else v) for k, v in ws.items()}
    assert not torch.equal(draft(sparse, ws, fs, 1).traces[0]["attn.core"],
                           draft(sparse, ws_big, fs, 1).traces[0]["attn.core"])


def test_sparse_with_topk_covering_context_equals_dense():
    # no sink: vLLM applies it on sparse layers only (test above)
    sparse = tiny(index_topk=64, learnable_sink=False)
    dense = sparse.replace(attention_sparse=False)
    w = random_weights(sparse, 3)
    first = make_case(sparse, 3, requests=3, tokens=8)
    a = draft(sparse, w, first, 3)
    dense_w = {k: v for k, v in w.items() if ".indexer." not in k}
    b = draft(dense, dense_w, first, 3)
    # same keys, gathered in another order: float64 softmax/sum order only
    for k in range(3):
        for name in ("attn.core", "final_norm", "logits"):
            torch.testing.assert_close(a.traces[k][name], b.traces[k][name], rtol=1e-10, atol=1e-12)


def test_topk_rows_are_causal_and_padded():
    cfg = tiny(index_topk=4)
    w = random_weights(cfg, 4)
    first = make_case(cfg, 4, lengths=[7, 2])
    tr = draft(cfg, w, first, 1).traces[0]
    rows, pos = tr["indexer.topk"], first.positions
    for i in range(rows.shape[0]):
        valid = rows[i][rows[i] >= 0]
        assert valid.numel() == min(4, int(pos[i]) + 1)
        assert int(valid.max()) <= int(pos[i])
        assert valid.unique().numel() == valid.numel()


def test_embedding_is_masked_at_position_zero_only():
    cfg = tiny()
    first = make_case(cfg, 0, lengths=[3, 2])
    tr = draft(cfg, random_weights(cfg, 0), first, 1).traces[0]
    zero = first.positions == 0
    assert torch.count_nonzero(tr["embed_masked"][zero]) == 0
    torch.testing.assert_close(tr["embed_masked"][~zero], tr["embed"][~zero])


def test_eh_proj_concatenates_embedding_first():
    cfg = tiny()
    w = random_weights(cfg, 0)
    first = make_case(cfg, 0, lengths=[3])
    tr = draft(cfg, w, first, 1).traces[0]
    expect = torch.cat([tr["enorm"], tr["hnorm"]], -1) @ w["layers.0.eh_proj"].T
    swapped = torch.cat([tr["hnorm"], tr["enorm"]], -1) @ w["layers.0.eh_proj"].T
    torch.testing.assert_close(tr["eh_proj"], expect)
    assert not torch.allclose(tr["eh_proj"], swapped)


@given(st.integers(0, 500), st.lists(st.integers(1, 9), min_size=1, max_size=4))
def test_index_sharing_reuses_the_compacted_last_token_rows(seed, lengths):
    cfg = tiny(index_topk=3, index_share_for_mtp_iteration=True)
    w = random_weights(cfg, seed)
    first = make_case(cfg, seed, lengths=lengths)
    res = draft(cfg, w, first, 3)
    last = first.last_rows()
    step0 = res.traces[0]["indexer.topk"]
    for k in (1, 2):
        tr = res.traces[k]
        assert "indexer.topk" not in tr, "the indexer must be skipped at steps >= 1 when sharing"
        assert torch.equal(tr["attn.topk"], step0[last])


def test_without_sharing_steps_run_their_own_indexer():
    cfg = tiny(index_topk=3)
    w = random_weights(cfg, 1)
    first = make_case(cfg, 1, lengths=[6, 5])
    res = draft(cfg, w, first, 2)
    tr = res.traces[1]
    assert torch.equal(tr["attn.topk"], tr["indexer.topk"])
    # a step-1 query at position p can select itself; the shared rows never can
    assert int(tr["indexer.topk"].max()) <= int(res.inputs[1].positions.max())


@given(st.lists(st.integers(0, 20), min_size=1, max_size=6), st.integers(0, 100))
def test_compaction_is_a_gather(slots, seed):
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(-1, 50, (24, 5), generator=g)
    slot_ids = torch.tensor(slots)
    out = compact_topk(buf, slot_ids)
    for i, s in enumerate(slots):
        assert torch.equal(out[i], buf[s])
    assert torch.equal(out[len(slots):], buf[len(slots):])


def test_steps_feed_greedy_token_position_and_normed_hidden():
    cfg = tiny()
    w = random_weights(cfg, 2)
    first = make_case(cfg, 2, lengths=[4, 6])
    res = draft(cfg, w, first, 3)
    for k in (1, 2):
        prev, inp = res.traces[k - 1], res.inputs[k]
        last = res.inputs[k - 1].last_rows()
        assert torch.equal(inp.input_ids, prev["draft_token"])
        assert torch.equal(inp.positions, res.inputs[k - 1].positions[last] + 1)
        torch.testing.assert_close(inp.hidden, prev["final_norm"][last])
    assert torch.equal(res.tokens[:, 0], res.traces[0]["draft_token"])


def test_spec_step_idx_cycles_over_mtp_layers():
    cfg = tiny(num_nextn_predict_layers=2, index_topk=64)
    w = random_weights(cfg, 0)
    first = make_case(cfg, 0, lengths=[3])
    # Step 1 runs MTP layer 1, whose draft KV for the context was never
    # written by step 0 (layer 0): vLLM would read stale cache there.
    with pytest.raises(UnwrittenKVError, match="layer 1"):
        draft(cfg, w, first, 2)
    # Prefill layer 1's context too (as a replay that fed it would) and the cycle runs.
    from reference import forward_step, layer_weights, shard_all
    cache = DraftCache()
    forward_step(cfg, shard_all(cfg, layer_weights(w, 1), 1), first, cache, 1)
    res = draft(cfg, w, first, 2, cache=cache)
    assert res.tokens.shape == (1, 2)
    # Step 1 ran layer 1: layer 0's weights give another hidden state.
    same = {**w, **{k.replace("layers.0.", "layers.1."): v for k, v in w.items() if k.startswith("layers.0.")}}
    cache0 = DraftCache()
    forward_step(cfg, shard_all(cfg, layer_weights(same, 1), 1), first, cache0, 1)
    other = draft(cfg, same, first, 2, cache=cache0)
    assert not torch.allclose(res.traces[1]["final_norm"], other.traces[1]["final_norm"])
    # Step 2 is back on layer 0, which never saw step 1's position.
    with pytest.raises(UnwrittenKVError, match="layer 0"):
        draft(cfg, w, first, 3, cache=cache)


def test_production_precision_stays_close_to_exact():
    cfg = tiny()
    w = random_weights(cfg, 0)
    first = make_case(cfg, 0, requests=2, tokens=6)
    a = draft(cfg, w, first, 1, EXACT).traces[0]
    b = draft(cfg, w, first, 1, PRODUCTION).traces[0]
    assert b["attn.core"].dtype == torch.bfloat16 and b["logits"].dtype == torch.float32
    rel = (b["final_norm"].double() - a["final_norm"]).norm() / a["final_norm"].norm()
    assert 0 < float(rel) < 0.05


def test_per_tensor_draw_is_seeded_by_name_and_thread_count_free():
    """``draw="per-tensor"`` (real-dims-k2's weights): the same names, shapes and storage
    precisions as the stream draw, other values; the same values on 1 and 2 threads; a tensor's
    values depend on (seed, name) only, so a second MTP layer leaves layer 0's untouched."""
    from reference.weights import is_fp32_param

    cfg = MTPConfig.from_hf_dict(preset("tiny"))
    stream = random_weights(cfg, 3)
    one = random_weights(cfg, 3, draw="per-tensor", threads=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # the default pool: PER_TENSOR_DRAW_THREADS where the cores are
        default = random_weights(cfg, 3, draw="per-tensor")
    finally:
        torch.set_num_threads(before)
    two = random_weights(cfg, 3, draw="per-tensor", threads=5)
    assert list(one) == list(stream) and all(one[k].shape == stream[k].shape for k in one)
    assert all(torch.equal(one[k], two[k]) and torch.equal(one[k], default[k]) for k in one)
    assert not torch.equal(one["layers.0.attn.q_a_proj"], stream["layers.0.attn.q_a_proj"])
    other_seed = random_weights(cfg, 4, draw="per-tensor")
    assert not torch.equal(one["layers.0.attn.q_a_proj"], other_seed["layers.0.attn.q_a_proj"])
    for k, v in one.items():  # stored precision: the values survive the round trip unchanged
        rounding = torch.float32 if is_fp32_param(k) else torch.bfloat16
        assert v.dtype == torch.float64 and torch.equal(v.to(rounding).to(torch.float64), v), k
    w = one["layers.0.mlp.experts.gate_proj"]  # N(0, 1 / in_features)
    # 5 %: the sampling error of the std of these >= 10^4 draws is < 1 %; a missing
    # 1/sqrt(in_features) scale would be off by a factor sqrt(in_features) >= 8
    assert w.numel() >= 10_000 and w.shape[-1] >= 64
    assert abs(w.std().item() * w.shape[-1] ** 0.5 - 1) < 0.05
    two_layers = random_weights(MTPConfig.from_hf_dict(preset("tiny", num_nextn_predict_layers=2)), 3,
                                draw="per-tensor")
    assert any(k.startswith("layers.1.") for k in two_layers)
    assert all(torch.equal(two_layers[k], v) for k, v in one.items())
    with pytest.raises(ValueError, match="draw='fast'"):
        random_weights(cfg, 3, draw="fast")
