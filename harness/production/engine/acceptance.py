"""Synthetic target + draft weights whose drafts the target accepts at a controlled rate (CPU, no vLLM).

The engine runs a real HY V4 target, so drafts are only ever accepted if the draft
predicts the target's greedy token. With random weights it never does. This module
builds weights where it does, per token, by construction:

Target. Every target layer's output projection is zero (attention ``o_proj``, the
dense MLP's / routed and shared experts' ``down`` projections), its final norm is 1
and iHC is off, so the target's hidden state at a row is ``RMSNorm(E[x])`` of that
row's token x alone and its greedy next token is ``f(x)``, a permutation of the
active tokens: ``lm_head[f(x)]`` is parallel to ``E[x]``. (Applied in place to the
live dummy-weight target by ``harness.production.engine``.)

Active tokens and codes. ``H`` tokens (ids 1..H) each own one hidden coordinate:
``E[t] = CODE * onehot(c(t)) + NOISE * N(0, 1)``. The first half (``AGREE``) own
coordinates 0..H/2-1, the second half (``DISAGREE``) the rest.

Draft. The MTP layer's ``eh_proj`` is ``[ALPHA * P, BETA * N(0, 1/H)]``: the token
half maps the code of x through ``P``, identity on AGREE coordinates and a
derangement of the DISAGREE coordinates, so the draft's residual points at x's code
when x agrees and at another token's code when it does not. The draft's attention and
MoE (the seeded weights of the case) add to that residual; ``ALPHA`` keeps the code
dominant, so the draft predicts ``f(x)`` for AGREE tokens and ``f(sigma(x)) != f(x)``
for DISAGREE tokens, with decisive logit margins (``margins`` measures them).

Requests. The target's token sequence follows ``f``'s cycles. A cycle's agree /
disagree pattern fixes its acceptance: all agree -> every draft accepted, all disagree
-> none, alternating or "agree, agree, disagree" -> partial (K=3: 1/3 and 2/3 of the
drafts). ``prompts`` ends each request on its pattern's cycle.
"""

from __future__ import annotations

import dataclasses
import math

import torch

CODE = 8.0  # one-hot code amplitude: half the embedding's energy (NOISE^2 * H = 64 at H = 256)
NOISE = 0.5
ALPHA = 4.0  # eh_proj gain on the token code: the code's share of the draft residual (see margins)
BETA = 0.25  # eh_proj gain on the previous hidden state: small, so hnorm still matters but never decides
HEAD = 1.0  # lm_head row norm

# cycle patterns of f, by name: True = agree token (draft right), False = disagree
PATTERNS = {
    "accept": (True,) * 8,
    "reject": (False,) * 8,
    "alternate": (True, False) * 4,
    "agree2": (True, True, False) * 3,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    hidden: int
    f: tuple  # f[t] = the target's greedy next token after t (active tokens; -1 elsewhere)
    draft_map: tuple  # the token the draft's code points at for t (t itself when t agrees)
    cycles: dict  # pattern name -> tuple of tokens in cycle order

    @property
    def active(self) -> range:
        return range(1, self.hidden + 1)

    def agrees(self, t: int) -> bool:
        return self.draft_map[t] == t


def plan_for(hidden: int, vocab: int, seed: int) -> Plan:
    if hidden % 2 or vocab <= hidden:
        raise ValueError(f"acceptance weights need an even hidden size below the vocab (H={hidden}, V={vocab})")
    g = torch.Generator().manual_seed(seed)
    half = hidden // 2
    agree = [1 + i for i in torch.randperm(half, generator=g).tolist()]
    disagree = [1 + half + i for i in torch.randperm(half, generator=g).tolist()]
    f = [-1] * vocab
    cycles = {}
    for name, pat in PATTERNS.items():
        cyc = tuple(agree.pop() if a else disagree.pop() for a in pat)
        cycles[name] = cyc
        for i, t in enumerate(cyc):
            f[t] = cyc[(i + 1) % len(cyc)]
    for rest in (agree, disagree):  # the remaining tokens of each half: one cycle each
        for i, t in enumerate(rest):
            f[t] = rest[(i + 1) % len(rest)]
    # sigma: a derangement of the disagree tokens (a cyclic shift of a random order)
    dis = [1 + half + i for i in torch.randperm(half, generator=g).tolist()]
    draft_map = list(range(vocab))
    for i, t in enumerate(dis):
        draft_map[t] = dis[(i + 1) % len(dis)]
    return Plan(hidden, tuple(f), tuple(draft_map), cycles)


def acceptance_weights(cfg, weights: dict, plan: Plan, seed: int) -> dict:
    """``weights`` (canonical names, float64 holding bf16 values) with the embedding,
    LM head and every MTP layer's ``eh_proj`` replaced as the module doc says."""
    h, v = cfg.hidden_size, cfg.vocab_size
    if plan.hidden != h:
        raise ValueError(f"plan for hidden size {plan.hidden}, config has {h}")
    g = torch.Generator().manual_seed(seed + 1)
    bf = lambda x: x.to(torch.bfloat16).to(torch.float64)  # noqa: E731 - bf16-representable, as stored
    out = dict(weights)
    emb = weights["embed_tokens"].clone()
    for t in plan.active:
        emb[t] = NOISE * torch.randn(h, generator=g, dtype=torch.float64)
        emb[t, t - 1] += CODE
    emb = bf(emb)
    head = torch.zeros(v, h, dtype=torch.float64)
    for t in plan.active:
        head[plan.f[t]] = HEAD * emb[t] / emb[t].norm()
    out["embed_tokens"], out["lm_head"] = emb, bf(head)
    perm = torch.zeros(h, h, dtype=torch.float64)
    for t in plan.active:
        perm[plan.draft_map[t] - 1, t - 1] = 1.0  # code of t -> code of draft_map[t]
    for i in range(cfg.num_mtp_layers):
        noise = torch.randn(h, h, generator=g, dtype=torch.float64) / math.sqrt(h)
        out[f"layers.{i}.eh_proj"] = bf(torch.cat([ALPHA * perm, BETA * noise], dim=1))
    return out


def prompts(plan: Plan, patterns, lengths, seed: int) -> list[list[int]]:
    """One prompt per (pattern, length): random active tokens ending on the pattern's cycle."""
    g = torch.Generator().manual_seed(seed + 2)
    out = []
    for name, n in zip(patterns, lengths):
        if name not in plan.cycles:
            raise ValueError(f"unknown acceptance pattern {name!r}; known: {', '.join(plan.cycles)}")
        p = (1 + torch.randint(0, plan.hidden, (n,), generator=g)).tolist()
        p[-1] = plan.cycles[name][0]
        out.append(p)
    return out


def target_tokens(plan: Plan, last: int, n: int) -> list[int]:
    """The target's greedy continuation of a sequence ending in ``last``: n tokens."""
    out, t = [], last
    for _ in range(n):
        t = plan.f[t]
        out.append(t)
    return out


def simulate_acceptance(plan: Plan, draft_fn, last: int, k: int, n_tokens: int) -> list[int]:
    """Accepted drafts per engine step of greedy speculative decoding where the target
    continues with ``f`` and ``draft_fn(token) -> token`` is the draft (CPU model of the
    engine, for choosing patterns; the engine run measures the real counts)."""
    accepted, t, made = [], last, 0
    while made < n_tokens:
        drafts, x = [], t
        for _ in range(k):
            x = draft_fn(x)
            drafts.append(x)
        truth = target_tokens(plan, t, k + 1)
        n = 0
        while n < k and drafts[n] == truth[n]:
            n += 1
        accepted.append(n)
        made += n + 1
        t = truth[n]
    return accepted


# ---- the live target (engine) -----------------------------------------------------------------

ZEROED_SUFFIXES = ("o_proj.weight", "down_proj.weight", "w2_weight")


def edit_target(target, embed: torch.Tensor, head: torch.Tensor) -> dict:
    """Make the live target compute ``f`` (module doc): zero every layer's output
    projections, final norm 1, embedding / LM head as given. Returns what was edited;
    raises when a layer kept a non-zero output path (vLLM renamed something)."""
    edited, layers_zeroed = [], {}
    with torch.no_grad():
        for name, p in target.named_parameters():
            if ".layers." in name and name.endswith(ZEROED_SUFFIXES):
                p.zero_()
                edited.append(name)
                layer = name.split(".layers.", 1)[1].split(".", 1)[0]
                layers_zeroed.setdefault(layer, []).append(name.rsplit(".", 2)[-2])
        inner = target.model
        inner.norm.weight.fill_(1.0)
        emb = inner.embed_tokens.weight
        emb[: embed.shape[0]].copy_(embed.to(emb.dtype))
        lm = target.lm_head.weight
        lm[: head.shape[0]].copy_(head.to(lm.dtype))
    n_layers = len(inner.layers)
    missing = [str(i) for i in range(n_layers) if len(layers_zeroed.get(str(i), [])) < 2]
    if missing:
        raise RuntimeError(f"target layers {missing} kept an output path: zeroed {layers_zeroed}")
    return {"zeroed": edited, "final_norm": "ones", "ihc": getattr(inner, "enable_ihc", None)}
