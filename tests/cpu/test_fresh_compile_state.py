"""A production session traces vLLM's torch.compile'd functions as a fresh process would.

vLLM's ``grouped_topk`` is ``torch.compile(dynamic=True)``: a call whose constants differ from an
earlier one (256 experts in 8 groups after 8 experts in 1 group) fails a guard and is recompiled
with what the earlier call specialised, which is another graph, so another Inductor cache key. A
warmup that compiled a case after other cases then did not cover the same case run first in a GPU
tier worker. ``fresh_compile_state`` (called by every ``ProductionSession``) makes the graph
independent of what ran before. Checked with a graph-recording backend (Dynamo only, no compiler)
on a function shaped like ``grouped_topk``: the failure mode, and the fix."""

from __future__ import annotations

from harness.production.module.runner import fresh_compile_state


def test_a_session_traces_as_a_fresh_process_whatever_ran_before():
    import torch._dynamo  # binds torch too

    graphs: list[str] = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    @torch.compile(dynamic=True, backend=record)
    def grouped(x, bias, topk: int, groups: int, scale: float):
        s = torch.sigmoid(x) + bias.unsqueeze(0)
        n = s.size(0)
        gs = s.view(n, groups, -1).amax(-1)
        m = torch.zeros_like(gs).scatter_(1, gs.topk(1, dim=-1)[1], 1)
        sm = m.unsqueeze(-1).expand(n, groups, s.size(-1) // groups).reshape(n, -1)
        v, i = s.masked_fill(~sm.bool(), float("-inf")).topk(topk, dim=-1)
        return v * scale, i

    tiny = (torch.randn(10, 8), torch.randn(8), 2, 1, 1.0)
    real = (torch.randn(45, 256), torch.randn(256), 8, 8, 2.5)
    try:
        fresh_compile_state()
        grouped(*real)
        fresh = graphs[-1]
        fresh_compile_state()
        grouped(*tiny)
        grouped(*real)  # a recompile: the graph carries the earlier call's specialisations
        assert len(graphs) == 3 and graphs[-1] != fresh
        grouped(*tiny)
        fresh_compile_state()  # what a new ProductionSession does
        grouped(*real)
        assert graphs[-1] == fresh
    finally:
        torch._dynamo.reset()
