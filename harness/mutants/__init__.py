"""Mutation testing of the side-by-side harness: does it catch real HYV4MTP bugs?

    python -m harness mutants [--list] [--only NAME ...] [--report R.json] [--no-control]

Each mutant stands for one bug HY V4 MTP could plausibly ship with. It is
applied *in process* to vLLM 0.33.0's real ``HYV4MTP`` after weights are
loaded (installed files are never edited): a parameter edited in place, an
attribute of the built model / attention impl / MoE router replaced, a
forward (pre-)hook, or a method replaced on the model *instance*. The model
of each mutant is built fresh and thrown away afterwards; attribute and hook
changes are undone in a ``finally`` as well, so mutants are independent.

A mutant is *detected* when the side-by-side verdict
(``harness.production.judging.trace_judge``) fails, or when the run raises after the mutant was
applied while the same case passes unmutated (the control). ``not-applicable``
(the attribute the mutant needs is absent in this vLLM build) is reported
apart from ``missed``. Exit: 0 every selected mutant detected, 1 otherwise,
125 production cannot run here.

The pure-function mutants (RoPE style, grouped-top-k routing flags) also run
on CPU: ``cpu_apply`` patches vLLM's pure PyTorch function and
``rope_cross_check`` / ``routing_cross_check`` (the comparisons of
tests/cpu/test_reference_vs_vllm_pure.py, returning problems instead of
asserting) must then report a problem; see tests/cpu/test_mutants_cpu.py.

Layout (one module per component area; the catalogue is derived from the component registry,
``harness.components``, whose records name the planted bugs that target them):

    base.py       Ctx (a loaded session + undo stack), the shared lookups, Planted / Mutant
    mtp_io.py     embed_masked, enorm, eh_proj, logits
    attention.py  attn.q_c, attn.kv_c, attn.q, attn.topk, attn.core, attn.out
    indexer.py    indexer.q_deq, indexer.k, indexer.head_weights, indexer.topk
    moe.py        moe.topk_ids, moe.topk_weights, moe.shared, mlp.out
    cpu.py        vLLM's pure functions patched + the CPU cross-checks
    catalogue.py  CATALOGUE / BY_NAME (registry order), select, format_list
    driver.py     the GPU runs (controls, mutants, report) and the ``mutants`` command

May import: torch, vLLM (lazily), ``reference``, ``harness`` and ``harness.production``
(``cases``, ``module``, ``engine.speculator_mutants``); nothing in ``harness`` below
``harness.cli`` / ``harness.commands`` imports it at module level.
"""

from .base import Ctx, Mutant, MutantNotApplicable, Planted, need
from .catalogue import BY_NAME, CATALOGUE, GOLDEN_CATALOGUE, format_list, select
from .cpu import ROPE_PARAMS, rope_cross_check, routing_cross_check, vllm_hf_config
from .driver import (_RunRaised, case_by_id, mutants_command, run_catalogue, run_control, run_mutant,
                     run_planted)

__all__ = [
    "BY_NAME", "CATALOGUE", "Ctx", "GOLDEN_CATALOGUE", "Mutant", "MutantNotApplicable", "Planted", "ROPE_PARAMS",
    "_RunRaised",
    "case_by_id", "format_list", "mutants_command", "need", "rope_cross_check",
    "routing_cross_check", "run_catalogue", "run_control", "run_mutant", "run_planted", "select",
    "vllm_hf_config",
]
