"""Named synthetic cases: one place that says which config, seed and batch a case is."""

from __future__ import annotations

import dataclasses

from reference import MTPConfig, StepInput, make_case, random_weights

from .presets import preset


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    preset: str
    overrides: tuple = ()  # ((key, value), ...) applied to the preset's HF dict
    seed: int = 0
    requests: int = 2
    tokens: int = 6
    steps: int = 2

    def hf_config(self) -> dict:
        return preset(self.preset, **dict(self.overrides))

    def config(self) -> MTPConfig:
        return MTPConfig.from_hf_dict(self.hf_config())

    def weights(self):
        return random_weights(self.config(), self.seed)

    def first_step(self) -> StepInput:
        return make_case(self.config(), self.seed, self.requests, self.tokens)


_SMALL_VOCAB = (("vocab_size", 512),)
# index_topk 4 < every context length here, so the indexer's choice matters.
_TOPK4 = (("index_topk", 4),)

CASES: dict[str, Case] = {c.id: c for c in (
    Case("tiny-moe-sink-elementwise", "tiny", _SMALL_VOCAB + _TOPK4, seed=1, steps=3),
    Case("tiny-dense-headwise-nosink", "tiny",
         _SMALL_VOCAB + _TOPK4 + (("mlp_layer_types", ["dense", "dense"]), ("gating_type", "headwise"),
                                  ("learnable_sink", False)), seed=2, steps=2),
    Case("tiny-share-indexer", "tiny",
         _SMALL_VOCAB + _TOPK4 + (("index_share_for_mtp_iteration", True),), seed=3, steps=3),
)}

GOLDEN_CASES = tuple(CASES)


def get_case(case_id: str) -> Case:
    if case_id not in CASES:
        raise KeyError(f"unknown case {case_id!r}; known: {', '.join(CASES)}")
    return CASES[case_id]
