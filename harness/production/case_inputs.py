"""The inputs of a side-by-side case (a ``GpuCase`` of ``harness.case_specs``, kind "module" of
``harness.case_registry``): ``CaseInputs`` / ``build_inputs`` (the HF config, the checkpoint
tensors for vLLM, the reference's weights and first step of a case), ``case_inputs`` (the same,
cached, for callers holding only a case), ``reload_set_b``. CPU only, no vLLM. Which cases exist
is the registry's to say (``harness.case_registry.specs(kind="module", ...)``).

May import: ``reference``, ``harness.case_specs``, ``harness.checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import tempfile

from harness.case_specs import GpuCase


@dataclasses.dataclass(frozen=True)
class CaseInputs:
    """Everything a side-by-side run and its judge read of one case, built once (``build_inputs``)
    and passed from the command down to the production run and the judge.

    bf16: the preset config, unquantized checkpoint tensors (cast to bf16/fp32 by the runner) and
    the seeded canonical weights. FP8: the config with ``mtp_quant_algo: FP8`` +
    ``quantization_config`` (as ``write_synthetic`` writes it), the tensors as stored (FP8 stays
    FP8) and ``LoadedCheckpoint.vllm_weights()``. A checkpoint directory: read like any real one.
    """

    case: GpuCase
    hf_config: dict       # the HF config vLLM builds from
    config: object        # reference.MTPConfig of ``hf_config``
    checkpoint: dict      # tensors for vLLM's load_weights, as stored
    weights: dict         # the reference's canonical weights (FP8: exactly what vLLM holds after loading)
    first: object         # reference.StepInput: the first draft step's inputs (seed, requests, tokens)


def build_inputs(case: GpuCase, loaded=None) -> CaseInputs:
    """The ``CaseInputs`` of ``case``: the one place they are made. ``loaded``: the
    ``LoadedCheckpoint`` of ``case.ckpt_dir`` where the caller already read it (not read again)."""
    import reference as R  # torch: only when inputs are made (case ids are checked without it)

    hf, ckpt, weights = _checkpoint_and_weights(case, loaded)
    cfg = R.MTPConfig.from_hf_dict(hf)
    return CaseInputs(case, hf, cfg, ckpt, weights, R.make_case(cfg, case.seed, case.requests, case.tokens))


def _checkpoint_and_weights(case: GpuCase, loaded=None) -> tuple[dict, dict, dict]:
    if case.ckpt_dir:  # a checkpoint on disk: read like any real one (FP8 stays FP8 for vLLM)
        if loaded is None:
            from harness.checkpoint.loader import load_checkpoint
            loaded = load_checkpoint(case.ckpt_dir)
        return loaded.hf_config, loaded.stored_tensors(), loaded.vllm_weights()
    import reference as R
    from harness.checkpoint.names import to_checkpoint

    hf = case.hf_config()
    cfg = R.MTPConfig.from_hf_dict(hf)
    weights = R.random_weights(cfg, case.seed, draw=case.weights_draw)
    if case.quant == "bf16":
        return hf, to_checkpoint(cfg, weights, case.naming, case.experts), weights
    # FP8: write the synthetic checkpoint and read it back like any real one, so
    # production gets the stored tensors (e4m3 + scales) and the reference the
    # exact dequantized weights vLLM holds after loading.
    from harness.checkpoint.loader import load_checkpoint
    from harness.checkpoint.synth import write_synthetic
    tmp = tempfile.mkdtemp(prefix=f"hyv4-{case.id}-")
    try:
        path = write_synthetic(os.path.join(tmp, "ckpt"), hf, weights, naming=case.naming,
                               experts=case.experts, quant=case.quant,
                               expert_scale_suffix=case.expert_scale_suffix, bf16_layers=case.bf16_layers,
                               ct_ignore_style=case.ct_ignore)
        loaded = load_checkpoint(path)
        return loaded.hf_config, loaded.stored_tensors(), loaded.vllm_weights()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.lru_cache(maxsize=4)
def _cached(case_json: str) -> tuple[dict, dict, dict]:
    return _checkpoint_and_weights(_case_from_dict(json.loads(case_json)))


def case_inputs(case: GpuCase) -> tuple[dict, dict, dict]:
    """(HF config, checkpoint tensors for vLLM's load_weights, reference weights) of ``case``, for
    callers that hold only a case (a TP worker process, the FP8 emulation, a re-judge of saved
    traces): cached per case, so repeated calls in one process share one build. A side-by-side
    run takes its ``CaseInputs`` from ``build_inputs`` instead and passes it down."""
    return _cached(json.dumps(dataclasses.asdict(case), sort_keys=True))


def _case_from_dict(d: dict) -> GpuCase:
    """Inverse of ``dataclasses.asdict`` (JSON lists back to the tuples the case holds)."""
    d = dict(d)
    d["overrides"] = tuple((k, v) for k, v in d.get("overrides", ()))
    for key in ("known_audit", "bf16_layers", "expect_unquantized"):
        d[key] = tuple(d.get(key, ()))
    d["upstream_gaps"] = tuple(tuple(g) for g in d.get("upstream_gaps", ()))
    return GpuCase(**d)


def reload_set_b(case: GpuCase) -> GpuCase:
    """The case of a reload case's weight set B: the same case with ``seed = reload_seed`` (its
    weights and its run's inputs), no further reload."""
    if case.reload_seed is None:
        raise ValueError(f"{case.id}: not a reload case (reload_seed is None)")
    return dataclasses.replace(case, seed=case.reload_seed, reload_seed=None)

