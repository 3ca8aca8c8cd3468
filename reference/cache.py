"""The draft model's own KV context, per MTP layer, indexed [request, position].

vLLM writes a token's latent KV (``kv_c`` after kv_a_layernorm, the roped
``k_pe``) and its FP8 indexer key into the caches before attention runs, so
a query attends to itself. A position is readable only once written; reading
an unwritten one is an error here, because in vLLM it reads stale memory.

Writes and reads are batched (one gather / scatter per field for a whole
step): ``write`` takes [T] requests and positions, ``read`` a [T, S] matrix of
positions per query row, -1 meaning "no key" (read as zeros).

``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``) says how the latent is stored:
"auto" keeps it as computed; "fp8" (vLLM's ``fp8_ds_mla`` rows for HY V4's sparse
layers) makes ``reference.mtp.forward_step`` store what those rows read back
(``reference.kv_cache.stored_kv``: FP8 latent with per-tile scales, bf16 rope).
"""

from __future__ import annotations

import torch


class UnwrittenKVError(RuntimeError):
    """A query would read a draft KV entry that nothing wrote (undefined in vLLM)."""


def _rows(request, position) -> tuple[torch.Tensor, torch.Tensor]:
    """(requests [T], positions [T]) as long tensors; ints are one row."""
    pos = torch.as_tensor(position, dtype=torch.long).reshape(-1)
    req = torch.as_tensor(request, dtype=torch.long, device=pos.device).reshape(-1).expand_as(pos)
    return req, pos


class DraftCache:
    """Per layer: entries [request, position, ...] and a ``written`` mask, grown on demand."""

    FIELDS = ("kv_c", "k_pe", "index_k")

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        from .kv_cache import canonical

        canonical(kv_cache_dtype)  # refuses a dtype the reference does not model
        self.kv_cache_dtype = kv_cache_dtype
        self._store: dict[int, dict[str, torch.Tensor]] = {}

    def write(self, layer: int, request, position, **entries: torch.Tensor) -> None:
        """Entry rows ``entries[name][i]`` at (``request[i]``, ``position[i]``), one row per
        distinct (request, position); ``request`` / ``position`` are [T] long tensors or ints
        (then each entry is one row without the leading dim)."""
        scalar = not isinstance(position, torch.Tensor) or position.dim() == 0
        entries = {k: (v[None] if scalar else v) for k, v in entries.items()}
        req, pos = _rows(request, position)
        slot = self._grow(layer, req, pos, next(iter(entries.values())).device)
        for name, value in entries.items():
            if name not in slot:
                slot[name] = value.new_zeros((*slot["written"].shape, *value.shape[1:]))
            slot[name][req, pos] = value
        slot["written"][req, pos] = True

    def _grow(self, layer: int, req: torch.Tensor, pos: torch.Tensor, device) -> dict[str, torch.Tensor]:
        """The layer's slot, with room for every (req, pos); capacities at least double."""
        slot = self._store.setdefault(layer, {"written": torch.zeros((0, 0), dtype=torch.bool, device=device)})
        need_r, need_p = (int(v) + 1 for v in torch.stack([req.max(), pos.max()]).tolist())
        cap_r, cap_p = slot["written"].shape
        if need_r > cap_r or need_p > cap_p:
            new_r, new_p = max(need_r, 2 * cap_r), max(need_p, 2 * cap_p)
            for name, old in list(slot.items()):
                grown = old.new_zeros((new_r, new_p, *old.shape[2:]))
                grown[:cap_r, :cap_p] = old
                slot[name] = grown
        return slot

    def read(self, layer: int, request, positions: torch.Tensor, name: str) -> torch.Tensor:
        """Entries of ``name`` at ``positions``; raises on unwritten ones.

        ``request`` int and ``positions`` [S] -> [S, ...]; or ``request`` [T] and
        ``positions`` [T, S] -> [T, S, ...] (row i reads request[i]); -1 = no key (zeros).
        """
        slot = self._store.get(layer)
        cap_r, cap_p = (0, 0) if slot is None else slot["written"].shape
        req = torch.as_tensor(request, dtype=torch.long, device=positions.device)
        req = req[..., None].expand_as(positions) if req.dim() else req.expand_as(positions)
        wanted = positions >= 0
        inside = (req < cap_r) & (positions < cap_p)
        r, p = req.clamp(max=max(cap_r - 1, 0)), positions.clamp(0, max(cap_p - 1, 0))
        ok = inside & slot["written"][r, p] if slot is not None else inside
        bad = wanted & ~ok
        if bool(bad.any()):
            where = torch.nonzero(bad)
            lr = int(req[tuple(where[0])])
            at = positions[bad & (req == lr)]
            raise UnwrittenKVError(
                f"MTP layer {layer}, request {lr}: draft KV at position(s) "
                f"{at[:8].tolist()} was never written (vLLM would read stale cache)")
        # one gather from the entries plus a zero row (index cap_r * cap_p) that every -1 reads:
        # the same values as torch.where(wanted, entries[r, p], 0) without a second pass over the
        # [T, S, ...] result (the float64 KV reads are the reference's largest tensors)
        store = slot[name]
        rest = store.shape[2:]
        flat = torch.cat([store.reshape(cap_r * cap_p, *rest), store.new_zeros((1, *rest))])
        idx = torch.where(wanted, r * cap_p + p, cap_r * cap_p)
        return flat.index_select(0, idx.reshape(-1)).reshape(*positions.shape, *rest)

    def invalidate(self, layer: int, request: int, positions) -> None:
        """Mark entries at ``positions`` as not written (content that must never be read,
        e.g. the KV production wrote from rejected rows); a later read of them raises."""
        slot = self._store.get(layer)
        if slot is None or request >= slot["written"].shape[0]:
            return
        for p in positions:
            if 0 <= int(p) < slot["written"].shape[1]:
                slot["written"][request, int(p)] = False

    def length(self, layer: int, request: int) -> int:
        """1 + the highest written position (0 when empty)."""
        slot = self._store.get(layer)
        if slot is None or request >= slot["written"].shape[0] or not bool(slot["written"][request].any()):
            return 0
        return int(torch.nonzero(slot["written"][request]).max()) + 1
