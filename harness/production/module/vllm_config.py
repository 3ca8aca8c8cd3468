"""A ``VllmConfig`` for the HY V4 target + MTP draft, built the way ``vllm serve`` builds it.

We write the synthetic HF config dict to a temporary model directory and go
through ``EngineArgs.create_engine_config`` (speculative method "mtp"), so the
draft model config, the MTP architecture rewrite (HYV4MTPModel) and the
platform's attention/cache overrides are vLLM's own.
"""

from __future__ import annotations

import json
import os
import tempfile

BLOCK_SIZE = 64  # FlashMLA sparse pages


def write_model_dir(hf_config: dict, root: str | None = None) -> str:
    """A directory holding only ``config.json`` (no tokenizer: skip_tokenizer_init); by default
    under this process's temp folder (``harness.production.process_temp.process_temp_dir``), which goes when
    the process ends: vLLM (and an engine's core process) reads it while the engine lives."""
    from harness.production.process_temp import process_temp_dir

    path = tempfile.mkdtemp(prefix="model-", dir=root or process_temp_dir())
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    return path


def build_vllm_config(hf_config: dict, *, num_speculative_tokens: int = 1,
                      max_model_len: int = 1024, max_num_batched_tokens: int = 1024,
                      max_num_seqs: int = 16, kv_cache_dtype: str = "auto",
                      extra_engine_args: dict | None = None):
    """``VllmConfig`` (eager, block size 64, bf16) for ``hf_config`` with an MTP draft.

    FP8 configs (``mtp_quant_algo: FP8`` + ``quantization_config``, as
    ``harness.checkpoint.synth`` writes them) pass ``quantization="fp8"``
    (``quantization_for``). Note: a ``scale_fmt: ue8m0`` config makes vLLM set
    ``VLLM_USE_DEEP_GEMM_E8M0=1`` in ``os.environ`` if unset (its default is 1 anyway).
    """
    from vllm.engine.arg_utils import EngineArgs

    from .. import run_hooks
    run_hooks.fire("before_vllm_config")  # e.g. a background model-class inspection is joined here
    model_dir = write_model_dir(hf_config)
    kwargs = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enforce_eager=True,
        kv_cache_dtype=kv_cache_dtype,
        load_format="dummy",
        speculative_config={"method": "mtp", "num_speculative_tokens": max(1, num_speculative_tokens)},
    )
    quant = quantization_for(hf_config)
    if quant is not None:
        kwargs["quantization"] = quant
    kwargs.update(extra_engine_args or {})
    return EngineArgs(**kwargs).create_engine_config()


def quantization_for(hf_config: dict) -> str | None:
    """The ``quantization`` engine argument for ``hf_config`` (None: unquantized).

    vLLM's ``ModelConfig._verify_quantization`` infers the method from
    ``quantization_config.quant_method`` (no override claims ``fp8`` for
    model_type hy_v4; ``deepseek_v4_fp8`` only for deepseek_v4*) and raises if
    an explicit argument disagrees, so we pass exactly that method. The target
    (never built) gets an ``Fp8Config``; ``HYV4MTP`` builds its own from
    ``mtp_quant_algo`` + ``quantization_config`` (block size, exclusions, UE8M0).
    A ModelOpt config (``quant_method: modelopt``, no ``mtp_quant_algo``) passes ``modelopt``:
    target and draft get a ``ModelOptFp8Config`` whose ``exclude_modules`` ``HYV4MTP`` remaps.
    Refused here, with the reason: ``mtp_quant_algo: FP8`` without
    ``quantization_config.weight_block_size`` (vLLM would build per-tensor FP8
    for the MTP layers, which the synthetic checkpoints do not hold).
    """
    qc = hf_config.get("quantization_config") or None
    algo = str(hf_config.get("mtp_quant_algo") or "").upper()
    if algo == "FP8" and not (qc and qc.get("weight_block_size")):
        raise ValueError("mtp_quant_algo FP8 needs quantization_config.weight_block_size (block FP8): "
                         "without it vLLM builds per-tensor FP8 MTP layers")
    if qc is None:
        return None
    method = qc.get("quant_method")
    if not method:
        raise ValueError(f"quantization_config without quant_method: {qc}")
    if method not in ("fp8", "modelopt", "compressed-tensors"):
        raise ValueError(f"quantization_config.quant_method {method!r}: the harness drives FP8 "
                         "(fp8, modelopt FP8_PB_WO, compressed-tensors channel / block FP8) only")
    return method
