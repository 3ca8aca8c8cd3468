"""The production path against the installed vLLM release, as far as a CPU goes.

Every supported release (harness/production/vllm_compat.py) runs this module in its own
environment (.ci/run: `-m vllm_facing` under requirements/vllm034.txt besides the default
one). On a faked SM90 platform the probe walks the module-level draft step the way
``ProductionSession`` does -- vLLM's config, HYV4MTP, ``load_weights``, every draft layer's
KV binding and metadata builders, the step-0 attention metadata build -- until the first
compiled kernel, and checks every vLLM internal the adapter names and every hook point the
engine path and the speculator mutants use. An API a release removed (0.34 dropped
``AttentionGroup.build_metadata_for_drafting``) fails here, not on a GPU host.

The other tests pin the adapter's and the kernel-path check's contracts without vLLM.
"""

from __future__ import annotations

import pytest

from harness.exitcodes import CannotJudge
from harness.production import kernel_paths, vllm_compat
from harness.production.engine import hook_points

WALK_CASES = ("tiny-k3-share", "tiny-k2-fp8-ue8m0-fused-scale-long")
VLLM_PROBE = {"walk": list(WALK_CASES)}

# the walk's steps in order; "forward" is reached only where no kernel stops it first
STEPS = ("vllm_config", "build_model", "load_weights", "internals+hook_points", "setup_draft_layers",
         "common_metadata", "build_step_metadata", "forward")


@pytest.mark.parametrize("case_id", WALK_CASES)
def test_the_draft_step_reaches_a_kernel_without_api_drift(vllm_probe, case_id):
    d = vllm_probe.walk[case_id]
    assert "crash" not in d, d.get("crash")
    assert d["internals_missing"] == [], d["internals_missing"]
    assert d["hook_point_problems"] == [], d["hook_point_problems"]
    reached = d["reached"]
    assert list(reached) == list(STEPS[:len(reached)]), reached
    # past the metadata builders' construction and the batch description at least ...
    assert "common_metadata" in reached, (d.get("stopped"), d.get("traceback"))
    # ... and then either the whole forward, or a compiled kernel (never an API error)
    if "forward" not in reached:
        assert d.get("kernel_stop"), f"stopped after {reached[-1]} by {d.get('stopped')}\n{d.get('traceback')}"
    # the builders are the sparse MLA and the indexer's, one per draft attention layer
    assert d["draft_layers"] and all(v.endswith("MetadataBuilder") for v in d["draft_layers"].values())


def test_an_internal_no_release_provides_is_one_cannot_judge_line(monkeypatch):
    gone = vllm_compat.Internal("x.gone", ("harness_no_such_module:thing", "harness.exitcodes:NoSuchName"),
                                "a thing the harness needs")
    monkeypatch.setitem(vllm_compat.INTERNALS, "x.gone", gone)
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: "9.9.9")
    with pytest.raises(CannotJudge) as exc:
        vllm_compat.internal("x.gone")
    line = str(exc.value)
    assert "\n" not in line and line.startswith("vLLM 9.9.9: x.gone (a thing the harness needs) not found")
    assert "harness_no_such_module:thing" in line and "harness.exitcodes:NoSuchName" in line
    assert vllm_compat.missing(["x.gone"]) and vllm_compat.missing(["x.gone"])[0].startswith("x.gone")


def test_the_first_location_that_resolves_wins(monkeypatch):
    moved = vllm_compat.Internal("x.moved", ("harness_no_such_module:f", "harness.exitcodes:worst"), "moved")
    monkeypatch.setitem(vllm_compat.INTERNALS, "x.moved", moved)
    from harness.exitcodes import worst
    assert vllm_compat.internal("x.moved") is worst
    assert vllm_compat.missing(["x.moved"]) == []


def test_hook_point_drift_is_named(monkeypatch):
    class Draft:  # forward lost spec_step_idx and swapped two parameters
        def forward(self, positions, input_ids, hidden_states):
            pass

        def compute_logits(self, hidden_states):
            pass

        def load_weights(self, weights):
            pass

    class Spec:
        def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                    num_sampled, num_rejected, last_sampled, dummy_run=False, num_speculative_tokens=None):
            pass

        def on_prefill_begin(self, num_reqs):
            pass

        def on_prefill_end(self, num_reqs):
            pass

        def capture(self):
            pass

        def run_fullgraph(self, desc):
            pass

        def on_multi_step_decode_begin(self, num_reqs):
            pass

        def _run_model(self, num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, spec_module_idx):
            pass

    import types
    mod = types.SimpleNamespace(prepare_prefill_inputs=lambda last_token_indices, current_draft_step,
                                input_buffers, input_batch: None,
                                dispatch_cg_and_sync_dp=lambda manager, num_reqs, need_eager=False: None)
    monkeypatch.setattr(vllm_compat, "internal", lambda name: mod if name.endswith("_module") else Spec)
    found = hook_points.problems(Draft)
    assert len(found) == 1, found
    assert found[0].startswith("HYV4MTP.forward (DrafterTap._record_inputs): no parameter spec_step_idx; "
                               "expected input_ids at 1 (found positions), positions at 2 (found input_ids)")


def _paths(**avail):
    return {n: {"available": a, "expected": True, "why": "" if a else f"{n} probe False"} for n, a in avail.items()}


def test_a_missing_kernel_path_a_normal_install_has_cannot_judge(monkeypatch):
    monkeypatch.delenv(kernel_paths.ALLOW_ENV, raising=False)
    paths = _paths(cute_dsl=False, flashinfer=True, deep_gemm=True)
    reason = kernel_paths.cannot_judge_reason(paths)
    assert reason and "cute_dsl (cute_dsl probe False)" in reason and "\n" not in reason
    assert kernel_paths.cannot_judge_reason(_paths(cute_dsl=True, flashinfer=True, deep_gemm=True)) is None
    not_expected = dict(paths, cute_dsl={"available": False, "expected": False, "why": "x"})
    assert kernel_paths.cannot_judge_reason(not_expected) is None  # not in vLLM's requirements: nothing missing
    assert kernel_paths.judged_without(paths) == ""  # not allowed: such a host does not judge at all
    monkeypatch.setenv(kernel_paths.ALLOW_ENV, "1")
    assert kernel_paths.cannot_judge_reason(paths) is None
    assert kernel_paths.judged_without(paths) == f" [judged WITHOUT cute_dsl: {kernel_paths.ALLOW_ENV}=1]"


def test_model_paths_read_every_router_tier_switch_whatever_its_name():
    import torch

    class GateLinear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.allow_ll_bf16_gemm, self.allow_some_future_tier, self.allowance = False, True, 3

    m = torch.nn.Module()
    m.gate = GateLinear()
    got = kernel_paths.model_paths(m)
    assert got["router_gates"] == {"gate": {"allow_ll_bf16_gemm": False, "allow_some_future_tier": True}}
