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
    """A directory holding only ``config.json`` (no tokenizer: skip_tokenizer_init)."""
    path = tempfile.mkdtemp(prefix="hyv4-mtp-", dir=root)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    return path


def build_vllm_config(hf_config: dict, *, num_speculative_tokens: int = 1,
                      max_model_len: int = 1024, max_num_batched_tokens: int = 1024,
                      max_num_seqs: int = 16, kv_cache_dtype: str = "auto",
                      extra_engine_args: dict | None = None):
    """``VllmConfig`` (eager, block size 64, bf16) for ``hf_config`` with an MTP draft."""
    from vllm.engine.arg_utils import EngineArgs

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
    kwargs.update(extra_engine_args or {})
    return EngineArgs(**kwargs).create_engine_config()
