"""The speculator's bookkeeping, checked against what the target did (CPU, no vLLM import).

``harness.production.engine`` records every target forward (``TargetCall``: ids,
positions, the hidden states it hands the drafter, the greedy token at every row it
computed logits for) and every draft forward (``draft_replay.DraftCall``). The replay
runs the reference on the draft forwards' *recorded* inputs; this module checks that
those inputs are the ones vLLM's speculator should have built, derived here
independently of vLLM's proposer code, so a regression in the speculator (which rows
it samples, which hidden state it feeds, which MTP layer runs) fails with the engine
step, draft step, request and quantity named.

Per engine step s (the s-th armed target forward pairs with the s-th ``propose``),
greedy decoding, for request r with target rows [a, b):

- accepted prefix: a decode request's rows hold [x, d_1 .. d_m] (its last token and
  the m drafts the scheduler verified); the target's greedy token g_j at row a + j
  decides: n = the longest prefix with d_{i} == g_{i-1}. A prefill (first row at
  position 0) has no drafts; its last row is the last accepted one.
- draft step 0 (``MTPSpeculator``, target_dependent_ar): the valid rows are a .. L
  with L = a + n (decode) or b - 1 (prefill); ``last_token_indices[r] == L`` and the
  sampled row is L; input ids = the target's ids shifted left by one with g_L (the
  token the target just sampled) at row L; positions = the target's; hidden rows = the
  target's output rows a .. L, bitwise.
- draft step k >= 1: one row per request, in step 0's request order: id = draft step
  k-1's token, position = its position + 1, hidden = the hidden row draft step k-1
  passed to ``compute_logits`` for that request, bitwise.
- ``MultiModuleMTPSpeculator``: every step runs the whole batch through MTP layer
  k mod n (``spec_step_idx`` = k); step 0 re-prefills the rejected-but-one drafts of the
  previous step in front of the window, so its last valid row is a + n + max(0, m - n - 1);
  step k >= 1 shifts step k-1's valid ids left by one and appends step k-1's draft token
  at the last row; positions stay step 0's.
- every draft forward: the MTP layer that ran is the expected one (single-module
  speculator: layer 0; multi-module: k mod n).

Per request, the acceptance counts follow vLLM's definition (``spec_counts``): a verify
step the target ran after the request had already generated its last token (async
scheduling runs one) is left out and reported apart.
"""

from __future__ import annotations

import dataclasses

import torch

from harness.production.engine.spec_counts import VerifyStep, summarize


@dataclasses.dataclass
class TargetCall:
    """One armed forward of the target model (tensors on CPU)."""

    engine_step: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, H] the target's output hidden states (what the drafter is fed)
    query_start_loc: torch.Tensor  # [R + 1]
    request_keys: torch.Tensor  # [R] block_table[:, 0]
    sample_rows: torch.Tensor | None = None  # [S] rows whose logits the target computed
    greedy: torch.Tensor | None = None  # [S] argmax of those logits

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclasses.dataclass
class Finding:
    engine_step: int
    draft_step: int
    request: str
    what: str  # the quantity, e.g. "last_token_indices", "input ids", "hidden", "MTP layer"
    detail: str

    def line(self) -> str:
        return (f"engine step {self.engine_step}, draft step {self.draft_step}, {self.request}: "
                f"{self.what}: {self.detail}")


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs expected {tuple(b.shape)}"
    bad = torch.nonzero(~(a == b).reshape(a.shape[0], -1).all(dim=-1)).flatten()
    r = int(bad[0])
    if a.dim() == 1:
        return f"row {r}: {int(a[r])}, expected {int(b[r])} ({bad.numel()} row(s) differ)"
    d = float((a[r].double() - b[r].double()).abs().max())
    return f"row {r} differs (max |d| {d:.4g}; {bad.numel()} row(s) differ)"


def check(calls, targets: list[TargetCall], *, multi_module: bool, num_layers: int,
          max_model_len: int, prompts: list | None = None, output_lens: list | None = None) -> dict:
    """``{"findings": [Finding...] in engine order, "acceptance": {...}, "checked": {...}}``.

    Requests are labelled ``request i`` when their prefill rows are prompt i of
    ``prompts`` (vLLM may batch them in another order, e.g. shortest first), else in
    order of appearance after the prompts. ``acceptance`` counts as vLLM does
    (``spec_counts``): ``output_lens[i]`` (the tokens request i generated in the end) tells
    which verify steps ran after request i had finished."""
    findings: list[Finding] = []
    checked = {"requests_steps": 0, "draft_calls": 0, "unchecked": 0}
    acc: dict[str, list] = {}  # request -> [spec_counts.VerifyStep]
    by_step: dict[int, list] = {}
    for c in calls:
        if c.engine_step >= 0:
            by_step.setdefault(c.engine_step, []).append(c)
    if targets and len(targets) != len(by_step):
        findings.append(Finding(-1, -1, "run", "pairing",
                                f"{len(targets)} target forwards for {len(by_step)} propose() calls"))
    labels: dict[int, int] = {}
    by_prompt = {tuple(p): i for i, p in enumerate(prompts or [])}
    next_label = [len(by_prompt)]

    def label(key: int, starts: bool, rows: torch.Tensor) -> str:
        if key not in labels or starts:
            i = by_prompt.get(tuple(rows.tolist())) if starts else None
            if i is None:
                i = next_label[0]
                next_label[0] += 1
            labels[key] = i
        return f"request {labels[key]}"

    for s, tc in enumerate(targets):
        steps = sorted(by_step.get(s, []), key=lambda c: c.draft_step)
        for c in steps:  # the MTP layer every draft forward ran
            want = c.draft_step % num_layers if multi_module else 0
            checked["draft_calls"] += 1
            if c.layer_ran is not None and c.layer_ran != want:
                findings.append(Finding(s, c.draft_step, "all requests", "MTP layer",
                                        f"layer {c.layer_ran} ran, expected layer {want} "
                                        f"({'spec_step_idx k mod n' if multi_module else 'single-module speculator'})"))
            if multi_module and c.spec_step_idx != c.draft_step:
                findings.append(Finding(s, c.draft_step, "all requests", "spec_step_idx",
                                        f"{c.spec_step_idx}, expected {c.draft_step}"))
        if not steps or steps[0].draft_step != 0:
            continue
        d0 = steps[0]
        qsl, keys = tc.query_start_loc.long().tolist(), tc.request_keys.long().tolist()
        if d0.query_start_loc.long().tolist() != qsl or d0.request_keys.long().tolist()[: len(keys)] != keys:
            findings.append(Finding(s, 0, "all requests", "batch",
                                    f"draft step 0 query_start_loc/requests {d0.query_start_loc.tolist()[:9]}/"
                                    f"{d0.request_keys.tolist()[:8]} are not the target's {qsl[:9]}/{keys[:8]}"))
            continue
        greedy = {}
        if tc.sample_rows is not None and tc.greedy is not None:
            greedy = {int(r): int(g) for r, g in zip(tc.sample_rows.tolist(), tc.greedy.tolist()) if r >= 0}
        lasts, names = [], []
        for r in range(len(keys)):
            a, b = qsl[r], qsl[r + 1]
            name = label(keys[r], int(tc.positions[a]) == 0, tc.input_ids[a:b])
            names.append(name)
            if b == a:
                lasts.append(None)
                continue
            prefill = int(tc.positions[a]) == 0
            if prefill:
                n, last = b - a - 1, b - 1
            else:
                m, n = b - a - 1, 0
                while n < m and (a + n) in greedy and int(tc.input_ids[a + n + 1]) == greedy[a + n]:
                    n += 1
                # multi-module: the last rejected-but-one drafts are re-prefilled in front of the
                # window, which moves the last valid row right by num_rejected - 1
                last = a + n + (max(0, m - n - 1) if multi_module else 0)
                # row a holds the last token the request sampled: position p follows p + 1 - prompt
                # length output tokens
                i = labels[keys[r]]
                before = (int(tc.positions[a]) + 1 - len(prompts[i])) if prompts and i < len(prompts) else None
                acc.setdefault(name, []).append(VerifyStep(s, n, m, before))
            if last not in greedy:
                checked["unchecked"] += 1
                lasts.append(None)
                continue
            checked["requests_steps"] += 1
            lasts.append(last)
            exp_ids = torch.cat([tc.input_ids[a + 1: last + 1].long(), torch.tensor([greedy[last]])])
            lti = d0.last_token_indices
            if lti is not None and lti.numel() > r and int(lti[r]) != last:
                findings.append(Finding(s, 0, name, "last_token_indices",
                                        f"{int(lti[r])}, expected {last} (accepted prefix {n} of {b - a - 1} "
                                        f"row(s) after the first; rows [{a}, {b}))"))
            if d0.sample_rows is not None and d0.sample_rows.numel() > r and int(d0.sample_rows[r]) != last:
                findings.append(Finding(s, 0, name, "sampled row",
                                        f"compute_logits got row {int(d0.sample_rows[r])}, expected the last "
                                        f"accepted row {last}"))
            if multi_module:  # the re-prefill window shifts step 0's rows: checked by the replay, not here
                continue
            got = d0.input_ids[a: last + 1].long()
            if not torch.equal(got, exp_ids):
                findings.append(Finding(s, 0, name, "input ids",
                                        f"not the target's ids shifted by one + its sampled token: "
                                        f"{_first_diff(got, exp_ids)}"))
            if not torch.equal(d0.positions[a: last + 1].long(), tc.positions[a: last + 1].long()):
                findings.append(Finding(s, 0, name, "positions", _first_diff(d0.positions[a: last + 1].long(),
                                                                             tc.positions[a: last + 1].long())))
            if not torch.equal(d0.hidden[a: last + 1], tc.hidden[a: last + 1].to(d0.hidden.dtype)):
                findings.append(Finding(s, 0, name, "hidden",
                                        "not the target's hidden states of the accepted rows: "
                                        + _first_diff(d0.hidden[a: last + 1],
                                                      tc.hidden[a: last + 1].to(d0.hidden.dtype))))
        _check_decode_steps(s, steps, lasts, names, multi_module, max_model_len, findings)
    outs = {f"request {i}": int(n) for i, n in enumerate(output_lens or [])}
    acceptance = {n: summarize(v, outs.get(n)) for n, v in acc.items()}
    return {"findings": findings, "acceptance": acceptance, "checked": checked}


def _check_decode_steps(s, steps, lasts, names, multi_module, max_model_len, findings) -> None:
    prev = steps[0]
    valid = [r for r, last in enumerate(lasts) if last is not None]
    if not multi_module:
        pos = {r: int(prev.positions[lasts[r]]) for r in valid}
    for c in steps[1:]:
        k = c.draft_step
        if prev.tokens is None:
            break
        if multi_module:
            qsl = c.query_start_loc.long().tolist()
            for j, r in enumerate(valid):
                last = lasts[r]
                a = qsl[r]
                if j >= prev.tokens.numel():
                    break
                exp = torch.cat([prev.input_ids[a + 1: last + 1].long(), prev.tokens[r: r + 1].long()])
                got = c.input_ids[a: last + 1].long()
                if not torch.equal(got, exp):
                    findings.append(Finding(s, k, names[r], "input ids",
                                            f"not step {k - 1}'s ids shifted by one + its draft token: "
                                            f"{_first_diff(got, exp)}"))
                if not torch.equal(c.positions[a: last + 1].long(), prev.positions[a: last + 1].long()):
                    findings.append(Finding(s, k, names[r], "positions", "moved between module steps"))
        else:
            nreq = len(lasts)
            if c.num_tokens != nreq:
                findings.append(Finding(s, k, "all requests", "batch", f"{c.num_tokens} rows for {nreq} requests"))
                break
            for r in valid:
                if r >= prev.tokens.numel():
                    continue
                if int(c.input_ids[r]) != int(prev.tokens[r]):
                    findings.append(Finding(s, k, names[r], "input ids",
                                            f"{int(c.input_ids[r])}, expected draft step {k - 1}'s token "
                                            f"{int(prev.tokens[r])}"))
                want = min(pos[r] + 1, max_model_len - 1)
                if int(c.positions[r]) != want:
                    findings.append(Finding(s, k, names[r], "positions", f"{int(c.positions[r])}, expected {want}"))
                pos[r] = want
                if prev.sample_hidden is not None and prev.sample_hidden.shape[0] > r:
                    if not torch.equal(c.hidden[r], prev.sample_hidden[r].to(c.hidden.dtype)):
                        d = float((c.hidden[r].double() - prev.sample_hidden[r].double()).abs().max())
                        findings.append(Finding(s, k, names[r], "hidden",
                                                f"not the hidden row draft step {k - 1} sampled for this request "
                                                f"(max |d| {d:.4g})"))
        prev = c
