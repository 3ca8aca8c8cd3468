"""Build vLLM's ``HYV4MTP`` and load checkpoint tensors into it, as vLLM's loader does.

``BaseModelLoader.load_model`` = ``initialize_model`` (under the model dtype and
target device) -> ``model.load_weights(iterable)`` -> ``process_weights_after_loading``.
We run the same three steps with our own iterable instead of files, then audit
the result (``audit.py``).
"""

from __future__ import annotations

import logging
import os
import socket

import torch

_DIST_READY: int | bool = False  # world size once joined


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(vllm_config, device: torch.device, *, world_size: int = 1, rank: int = 0,
                     init_method: str | None = None) -> None:
    """This process's rank of a ``world_size`` tensor-parallel group (once per process).

    ``world_size`` 1 picks a free local port; for ``world_size`` > 1 every rank
    must pass the same ``init_method`` (``tcp://host:port``) and ``device`` is
    this rank's GPU (``local_rank`` = its index), as vLLM's workers do.
    """
    global _DIST_READY
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    if _DIST_READY:
        if world_size != _DIST_READY:
            raise RuntimeError(f"this process already joined a world of size {_DIST_READY}; "
                               f"a world of size {world_size} needs fresh processes")
        return
    if world_size > 1 and init_method is None:
        raise ValueError("world_size > 1 needs one init_method shared by every rank")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    local_rank = device.index if device.index is not None else rank
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=world_size, rank=rank, local_rank=local_rank,
                                     distributed_init_method=init_method or f"tcp://127.0.0.1:{free_port()}",
                                     backend=backend)
        ensure_model_parallel_initialized(world_size, 1)
    try:
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized
        if not is_workspace_manager_initialized():
            init_workspace_manager(device)
    except ImportError:  # older vLLM: no workspace manager
        pass
    _DIST_READY = world_size


class _WarningTap(logging.Handler):
    """Collects the warnings vLLM's MTP loader logs (unknown / unassigned weights)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def build_model(vllm_config, device: torch.device):
    """``HYV4MTP`` with uninitialised weights, on ``device``, under ``vllm_config``."""
    from vllm.config import set_current_vllm_config

    from harness.production import vllm_compat

    initialize_model = vllm_compat.internal("loader.initialize_model")
    set_default_torch_dtype = vllm_compat.internal("torch_utils.set_default_torch_dtype")
    draft_mc = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(draft_mc.dtype), device:
        model = initialize_model(vllm_config=vllm_config, model_config=draft_mc)
    return model


def load_checkpoint(model, vllm_config, ckpt: dict[str, torch.Tensor], device: torch.device):
    """``model.load_weights`` + ``process_weights_after_loading``; returns (loaded names, warnings)."""
    from vllm.config import set_current_vllm_config

    from harness.production import vllm_compat

    process_weights_after_loading = vllm_compat.internal("loader.process_weights_after_loading")
    draft_mc = vllm_config.speculative_config.draft_model_config
    tap = _WarningTap()
    loggers = [logging.getLogger(n) for n in ("vllm.models.hy_v4.nvidia.mtp", "vllm.models.hy_v4.nvidia.model",
                                                "vllm.model_executor.models.hy_v4.nvidia.mtp")]
    for lg in loggers:
        lg.addHandler(tap)
    try:
        with set_current_vllm_config(vllm_config):
            loaded = model.load_weights(iter(sorted(ckpt.items())))
            pre_process_params = {n: p for n, p in model.named_parameters()}
            process_weights_after_loading(model, draft_mc, device)
    finally:
        for lg in loggers:
            lg.removeHandler(tap)
    return set(loaded or ()), pre_process_params, tap.messages
