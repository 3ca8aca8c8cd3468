"""Paged KV caches for the draft's attention layers and per-step attention metadata.

Every layer that registered itself in ``static_forward_context`` (the MLA
attention and the indexer's FP8 key cache) gets a zeroed cache of
``[num_blocks, 1, block_size, row]`` bound through its own ``bind_kv_cache``,
and a metadata builder from its own backend (``backend.get_builder_cls()``).
Request r owns blocks ``1 + r*B .. (r+1)*B`` (block 0 stays unused, as the
null block of vLLM's block pool).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch


@dataclasses.dataclass
class DraftLayer:
    name: str
    layer: object
    spec: object
    backend: type
    group: object  # vLLM's AttentionGroup (owns the metadata builder)


def _row_shape(spec) -> tuple[torch.dtype, int]:
    content = getattr(spec, "state_content_bytes", None)
    if content:  # packed fp8_ds_mla / nvfp4 rows: opaque bytes
        return torch.uint8, int(content)
    return spec.dtype, int(spec.head_size)


def setup_draft_layers(vllm_config, device: torch.device, num_blocks: int) -> list[DraftLayer]:
    """Allocate + bind a KV cache and create a metadata builder for every draft attention layer."""
    from vllm.config import set_current_vllm_config

    from harness.production import vllm_compat

    out = []
    ctx = vllm_config.compilation_config.static_forward_context
    with set_current_vllm_config(vllm_config):
        for name, layer in ctx.items():
            if not hasattr(layer, "get_kv_cache_spec"):
                continue
            spec = layer.get_kv_cache_spec(vllm_config)
            if spec is None:
                continue
            backend = layer.get_attn_backend()
            if hasattr(backend, "customize_spec"):
                try:
                    spec = backend.customize_spec(spec)
                except Exception:  # noqa: BLE001 - keep the layer's own spec
                    pass
            dtype, row = _row_shape(spec)
            cache = torch.zeros((num_blocks, 1, spec.block_size, row), dtype=dtype, device=device)
            layer.bind_kv_cache(cache)
            # The runner's own wrapper: it passes block_table_width to builders
            # that need it (the indexer's) and maps block tables to kernel blocks.
            AttentionGroup = vllm_compat.internal("worker.AttentionGroup")
            group = AttentionGroup(backend=backend, layer_names=[name], kv_cache_spec=spec,
                                   kv_cache_group_id=len(out))
            group.create_metadata_builders(vllm_config, device)
            out.append(DraftLayer(name, layer, spec, backend, group))
    return out


def block_table_width(vllm_config) -> int:
    """Width of the runner's block table for this config (vLLM's alignment rule)."""
    from vllm.utils.math_utils import cdiv
    bs = vllm_config.cache_config.block_size
    max_blocks = cdiv(vllm_config.model_config.max_model_len, bs)
    try:
        from vllm.v1.worker.block_table import get_block_table_width
        return int(get_block_table_width(max_blocks, bs))
    except ImportError:  # pragma: no cover
        return max_blocks


@dataclasses.dataclass
class BatchLayout:
    """Block table of R requests with ``blocks_per_request`` blocks each."""

    num_requests: int
    blocks_per_request: int
    block_size: int
    width: int = 0  # table width (>= blocks_per_request); unused entries are 0

    @property
    def num_blocks(self) -> int:
        return 1 + self.num_requests * self.blocks_per_request

    def block_table(self) -> torch.Tensor:
        bt = torch.arange(self.num_requests * self.blocks_per_request, dtype=torch.int32)
        bt = bt.reshape(self.num_requests, self.blocks_per_request) + 1
        width = max(self.width, self.blocks_per_request)
        out = torch.zeros(self.num_requests, width, dtype=torch.int32)
        out[:, : self.blocks_per_request] = bt
        return out

    def slots(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bt = self.block_table()
        blk = bt[requests, positions // self.block_size].to(torch.int64)
        return blk * self.block_size + positions % self.block_size


def common_metadata(layout: BatchLayout, requests: torch.Tensor, positions: torch.Tensor,
                    seq_lens: list[int], device: torch.device):
    """``CommonAttentionMetadata`` for a request-major token batch.

    requests/positions: [T] (CPU, long). seq_lens: per request, the context
    length after this step's tokens are written (position of its last token + 1).
    """
    from harness.production import vllm_compat

    CommonAttentionMetadata = vllm_compat.internal("attention.CommonAttentionMetadata")
    r = layout.num_requests
    qlens = torch.bincount(requests, minlength=r).to(torch.int32)
    qsl = torch.zeros(r + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(qlens, 0)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    slot = layout.slots(requests, positions)
    fields = dict(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=sl.to(device),
        num_reqs=r,
        num_actual_tokens=int(requests.numel()),
        max_query_len=int(qlens.max()),
        max_seq_len=int(sl.max()),
        block_table_tensor=layout.block_table().to(device),
        slot_mapping=slot.to(device),
    )
    optional = dict(positions=positions.to(device), seq_lens_cpu_upper_bound=sl.clone(),
                    req_idx=np.arange(r))
    names = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    fields.update({k: v for k, v in optional.items() if k in names})
    return CommonAttentionMetadata(**fields)


def build_step_metadata(layers: list[DraftLayer], cam, draft_index: int, vllm_config):
    """({layer: metadata}, {layer: slot_mapping}) as the V2 speculator's builders produce them.

    Every draft step, step 0 included, goes through ``AttentionGroup.build_metadata``
    (common prefix 0), which is what ``gpu/attn_utils.build_attn_metadata`` calls for the
    speculator's prefill and decode steps; ``draft_index`` only names the step."""
    from vllm.config import set_current_vllm_config

    from harness.production import vllm_compat

    build = vllm_compat.internal("worker.AttentionGroup.build_metadata")
    md, slots = {}, {}
    with set_current_vllm_config(vllm_config):
        for dl in layers:
            md[dl.name] = build(dl.group, cam)
            slots[dl.name] = cam.slot_mapping
    return md, slots
