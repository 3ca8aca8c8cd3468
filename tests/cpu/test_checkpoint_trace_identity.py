"""The reference trace of one seed is identical across every checkpoint layout
of the same precision (naming x expert layout), and bf16 differs from FP8."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.synth import synth_config, write_synthetic
from reference import EXACT, MTPConfig, draft, make_case, random_weights

LAYOUTS = list(itertools.product(("mtp_layers", "layers"), ("split", "fused")))


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    hf = synth_config("tiny", vocab_size=128, index_topk=4)
    cfg = MTPConfig.from_hf_dict(hf)
    w = random_weights(cfg, 7)
    first = make_case(cfg, 7, lengths=[6, 3])
    out = {}
    for quant in ("bf16", "fp8", "fp8-ue8m0"):
        for naming, experts in LAYOUTS:
            d = write_synthetic(root / f"{quant}-{naming}-{experts}", hf, w,
                                naming=naming, experts=experts, quant=quant)
            ck = load_checkpoint(d)
            out[quant, naming, experts] = draft(ck.cfg, ck.weights, first, 2, EXACT).traces
    return out


@pytest.mark.parametrize("quant", ["bf16", "fp8", "fp8-ue8m0"])
def test_trace_is_identical_across_layouts(traces, quant):
    base = traces[(quant, *LAYOUTS[0])]
    for layout in LAYOUTS[1:]:
        other = traces[(quant, *layout)]
        for k, tr in enumerate(base):
            for name, v in tr.items():
                assert torch.equal(other[k][name], v), f"{quant} {layout} step{k}.{name}"


def test_fp8_changes_the_trace(traces):
    a = traces[("bf16", *LAYOUTS[0])][0]["attn.core"]
    b = traces[("fp8", *LAYOUTS[0])][0]["attn.core"]
    assert not torch.equal(a, b)
