"""The draft model's own KV context, per MTP layer and per request.

vLLM writes a token's latent KV (``kv_c`` after kv_a_layernorm, the roped
``k_pe``) and its FP8 indexer key into the caches before attention runs, so
a query attends to itself. A position is readable only once written; reading
an unwritten one is an error here, because in vLLM it reads stale memory.
"""

from __future__ import annotations

import torch


class UnwrittenKVError(RuntimeError):
    """A query would read a draft KV entry that nothing wrote (undefined in vLLM)."""


class DraftCache:
    """Entries [position, ...] per (layer, request), grown on demand."""

    FIELDS = ("kv_c", "k_pe", "index_k")

    def __init__(self) -> None:
        self._store: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    def write(self, layer: int, request: int, position: int, **entries: torch.Tensor) -> None:
        device = next(iter(entries.values())).device
        slot = self._store.setdefault((layer, request), {"written": torch.zeros(0, dtype=torch.bool, device=device)})
        cap = slot["written"].numel()
        if position >= cap:
            grow = max(position + 1, 2 * cap) - cap
            for name, old in list(slot.items()):
                slot[name] = torch.cat([old, old.new_zeros((grow, *old.shape[1:]))])
            cap += grow
        for name, value in entries.items():
            if name not in slot:
                slot[name] = torch.zeros((cap, *value.shape), dtype=value.dtype, device=value.device)
            slot[name][position] = value
        slot["written"][position] = True

    def read(self, layer: int, request: int, positions: torch.Tensor, name: str) -> torch.Tensor:
        """Entries of ``name`` at ``positions`` (1-D long); raises on unwritten ones."""
        slot = self._store.get((layer, request))
        cap = 0 if slot is None else slot["written"].numel()
        bad = positions[(positions >= cap)]
        if bad.numel() == 0 and slot is not None:
            bad = positions[~slot["written"][positions]]
        if bad.numel():
            raise UnwrittenKVError(
                f"MTP layer {layer}, request {request}: draft KV at position(s) "
                f"{bad[:8].tolist()} was never written (vLLM would read stale cache)")
        assert slot is not None
        return slot[name][positions]

    def invalidate(self, layer: int, request: int, positions) -> None:
        """Mark entries at ``positions`` as not written (content that must never be read,
        e.g. the KV production wrote from rejected rows); a later read of them raises."""
        slot = self._store.get((layer, request))
        if slot is None:
            return
        for p in positions:
            if 0 <= int(p) < slot["written"].numel():
                slot["written"][int(p)] = False

    def length(self, layer: int, request: int) -> int:
        """1 + the highest written position (0 when empty)."""
        slot = self._store.get((layer, request))
        if slot is None or not bool(slot["written"].any()):
            return 0
        return int(torch.nonzero(slot["written"]).max()) + 1
