"""The files of a safetensors checkpoint, read without trusting them: where each tensor is
(``_locate``: the index's weight map, or the single ``model.safetensors``), every listed shard's
header checked entry by entry (dtype, shape, ``data_offsets`` that overlap, leave holes or lie; a
tensor two shards hold; an MTP tensor outside the index), and ``_Reader``, which reads one tensor
by ``os.pread`` of the span its checked header gives (no memory map: a shard truncated while it
is read is a short read named, not a SIGBUS). Every failure is a ``CheckpointError`` naming the
file and the tensor. What the tensors mean is ``loader``'s job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import torch

from .errors import CheckpointError
from .names import SHARED, parse_layer_name

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtype -> torch dtype (what the reader views a tensor's bytes as)
_TORCH_DTYPE = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn,
                "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu, "I16": torch.int16,
                "U16": torch.uint16, "F16": torch.float16, "BF16": torch.bfloat16, "I32": torch.int32,
                "U32": torch.uint32, "F32": torch.float32, "I64": torch.int64, "U64": torch.uint64,
                "F64": torch.float64}

def _not_a_file(path: Path) -> str | None:
    """Why ``path`` cannot be a shard ("does not exist", "is a FIFO", ...), None for a regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "which is a symbolic link that points nowhere" if os.path.islink(path) else "which does not exist"
    except OSError as exc:
        return f"which cannot be looked up: {exc.strerror or exc}"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a device node" if stat.S_ISCHR(st.st_mode)
            or stat.S_ISBLK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
    return f"which is {kind}, not a regular safetensors file"


class _Reader:
    """Reads single tensors of the shards with ``os.pread`` from the spans their (checked) header
    gives, wrapping every failure. No memory map: a shard truncated or rewritten while it is read
    is a short read (``CheckpointError`` naming the tensor), never a SIGBUS that kills the process."""

    def __init__(self, root: Path, where: dict[str, str], index_file: Path | None):
        self.root, self.where, self.index_file = root, where, index_file
        self.handles: dict[str, _ShardHeader] = {}

    def _handle(self, name: str):
        fname = self.where[name]
        path = self.root / fname
        if fname not in self.handles:
            why = _not_a_file(path)
            if why is not None:
                raise CheckpointError(self.index_file or path, name, f"the index maps it to {fname}, {why}")
            self.handles[fname] = _read_header(path)  # a header that lies about a tensor names that tensor
        h = self.handles[fname]
        if name not in h.entries:
            raise CheckpointError(path, name, "the index maps this tensor here but the file's header "
                                  "does not hold it")
        return h, path

    def meta(self, name: str) -> tuple[Path, tuple[int, ...], str]:
        h, path = self._handle(name)
        dtype, shape, _, _ = h.entries[name]
        return path, tuple(shape), dtype

    def read(self, name: str) -> tuple[Path, torch.Tensor]:
        h, path = self._handle(name)
        dtype, shape, start, end = h.entries[name]
        n = end - start
        buf = bytearray(n)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise CheckpointError(path, name, "the file was replaced by one that is not a regular file "
                                          "while the checkpoint was read")
                got, view = 0, memoryview(buf)
                while got < n:
                    k = os.preadv(fd, [view[got:]], h.data_start + start + got)
                    if k == 0:
                        break
                    got += k
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(path, name, f"could not read the tensor data: {exc.strerror or exc}") from exc
        if got != n:
            raise CheckpointError(path, name, f"the file changed while it was read: the tensor's {n} bytes at "
                                  f"offset {h.data_start + start} of the file, only {got} there now (truncated?)")
        tdt = _TORCH_DTYPE.get(dtype)
        if tdt is None:
            raise CheckpointError(path, name, f"dtype {dtype} is not one torch reads")
        t = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        return path, t.view(tdt).reshape(shape)

    def path(self, name: str) -> Path:
        return self.root / self.where[name]


# config.json and the index of a real checkpoint are kilobytes to a few MiB; the trace copies the
# config into a safetensors header, which safetensors caps at 100 MB
MAX_JSON_BYTES = 16 << 20


def _load_json(path: Path, what: str):
    def no_dupes(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CheckpointError(path, k, f"listed twice in {what}")
            seen[k] = v
        return seen

    try:
        st = path.stat()
        size = st.st_size
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read forever
            raise CheckpointError(path, None, f"{what} is not a regular file")
        if size > MAX_JSON_BYTES:
            raise CheckpointError(path, None, f"{what} is {size} bytes, more than any model's "
                                  f"({MAX_JSON_BYTES >> 20} MiB at most)")
        return json.loads(path.read_text(), object_pairs_hook=no_dupes)
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: bad JSON, not UTF-8, a number past Python's digit limit
        raise CheckpointError(path, None, f"cannot read {what}: {str(exc)[:300]}") from exc
    except RecursionError as exc:
        raise CheckpointError(path, None, f"cannot read {what}: nested deeper than a JSON parser follows") from exc


def _locate(root: Path, num_hidden_layers: int | None = None) -> tuple[dict[str, str], Path | None]:
    """tensor name -> shard file name, and the index path (None for a single file).

    With ``num_hidden_layers`` the shard headers are checked against the index
    (``_check_shard_headers``)."""
    idx = root / INDEX
    if os.path.lexists(idx):  # a FIFO or directory there is refused by _load_json, never passed over
        data = _load_json(idx, "the index")
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointError(idx, None, "has no weight_map of tensor name -> file name")
        for name, fname in wm.items():
            if "/" in fname or fname.startswith("."):
                raise CheckpointError(idx, name, f"maps to {fname!r}, outside the checkpoint directory")
        if num_hidden_layers is not None:
            _check_shard_headers(root, wm, idx, num_hidden_layers)
        return dict(wm), idx
    single = root / SINGLE
    if os.path.lexists(single):
        keys = list(_read_header(single).entries)  # names the tensor whose header entry lies
        return {k: SINGLE for k in keys}, None
    raise CheckpointError(root, None, f"no {INDEX} and no {SINGLE}")


@dataclasses.dataclass
class _ShardHeader:
    data_start: int  # file offset of the data section (8 + header length)
    entries: dict    # name -> (safetensors dtype, shape, start, end): byte span in the data section


# safetensors refuses headers above 100 MB (its MAX_HEADER_SIZE); so does the harness, before reading
MAX_HEADER_BYTES = 100_000_000


def _shard_header(path: Path) -> dict:
    """{tensor name: (start, end)} of the safetensors file at ``path`` (``_read_header``)."""
    return {k: (v[2], v[3]) for k, v in _read_header(path).entries.items()}


def _read_header(path: Path) -> _ShardHeader:
    """The JSON header of the safetensors file at ``path``, checked entry by entry before any data
    is read: each tensor's dtype, shape and ``data_offsets`` (two ints, in order, spanning exactly
    dtype x shape), no tensor listed twice, no two spans overlapping, no hole between them, all
    inside the file (a truncated shard names its tensor). Every error names the tensor and the offset."""
    why = _not_a_file(path)
    if why is not None:
        raise CheckpointError(path, None, why.removeprefix("which "))
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 2 or 8 + n > size or n > MAX_HEADER_BYTES:
                raise CheckpointError(path, None, "not a readable safetensors file (truncated or corrupt header: "
                                      f"header length {n}, file size {size}"
                                      + (f", more than safetensors' {MAX_HEADER_BYTES}" if n > MAX_HEADER_BYTES else "")
                                      + ")")
            raw = fh.read(n)
    except OSError as exc:
        raise CheckpointError(path, None, f"cannot read the file: {exc.strerror or exc}") from exc

    def no_dupes(pairs):
        seen = {}
        for k, v in pairs:
            if k in seen:
                raise CheckpointError(path, k, "listed twice in the file's safetensors header (which one "
                                      "a reader keeps is up to it)")
            seen[k] = v
        return seen

    try:
        hdr = json.loads(raw, object_pairs_hook=no_dupes)
    except CheckpointError:
        raise
    except (ValueError, RecursionError) as exc:
        raise CheckpointError(path, None, "not a readable safetensors file (corrupt header: "
                              f"{exc.__class__.__name__}: {str(exc)[:200]})") from exc
    if not isinstance(hdr, dict):
        raise CheckpointError(path, None, "not a readable safetensors file (corrupt header: a JSON "
                              f"{type(hdr).__name__}, not an object)")
    meta = hdr.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(path, "__metadata__", "corrupt header entry: must map names to strings")
    entries = {}
    for name, entry in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise CheckpointError(path, name, f"corrupt header entry: a JSON {type(entry).__name__}, not an object")
        offs = entry.get("data_offsets")
        if not (isinstance(offs, list) and len(offs) == 2):
            raise CheckpointError(path, name, f"corrupt header entry: data_offsets {str(offs)[:60]} must be "
                                  "[start, end], two byte offsets")
        for which, o in zip(("start", "end"), offs):
            if not (isinstance(o, int) and not isinstance(o, bool)) or o < 0:
                raise CheckpointError(path, name, f"corrupt header entry: data_offsets {which} {json.dumps(o)[:40]} "
                                      "must be a non-negative int (a byte offset into the data section)")
        start, end = offs
        _check_span(path, name, entry, start, end)
        entries[name] = (entry["dtype"], tuple(entry["shape"]), start, end)
    data = size - 8 - n
    spans = sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3]))
    prev_name, prev_end = None, 0
    for name, (_, _, start, end) in spans:
        if start < prev_end:
            raise CheckpointError(path, name, f"corrupt header entry: data_offsets [{start}, {end}] overlap "
                                  f"{prev_name}'s, which ends at byte {prev_end} of the data section")
        if start > prev_end:
            raise CheckpointError(path, name, f"corrupt header entry: data_offsets start {start}, but "
                                  + (f"{prev_name} ends at byte {prev_end}" if prev_name else "the data section "
                                     "starts at byte 0") + ": a hole of unlisted bytes (safetensors refuses it)")
        prev_name, prev_end = name, end
    for name, (_, _, start, end) in reversed(spans):
        if end > data:
            raise CheckpointError(path, name, f"truncated or corrupt file: the tensor's data ends at byte {end} "
                                  f"of the data section, which holds {data} bytes")
        if end < data:
            raise CheckpointError(path, name, f"corrupt file: the last tensor's data ends at byte {end} of the "
                                  f"data section, which holds {data} bytes ({data - end} unlisted bytes after it; "
                                  "safetensors refuses the file)")
        break
    return _ShardHeader(8 + n, entries)


# bytes per element of each safetensors dtype
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_span(path: Path, name: str, entry, start: int, end: int) -> None:
    """The header entry of ``name``: a known dtype, a shape of ints, and a byte span that holds
    exactly shape x itemsize (a header that lies about a dtype or shape names its tensor)."""
    dtype, shape = entry.get("dtype"), entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise CheckpointError(path, name, f"corrupt header entry: shape {str(shape)[:60]}")
    if not isinstance(dtype, str) or dtype not in _ST_ITEMSIZE:
        raise CheckpointError(path, name, f"corrupt header entry: unknown dtype {str(dtype)[:40]!r}")
    want = _ST_ITEMSIZE[dtype]
    for d in shape:
        want *= d
    if end < start or end - start != want:
        raise CheckpointError(path, name, f"corrupt header entry: dtype {_st_dtype(dtype)} x shape {shape} is "
                              f"{want} bytes, but its data span is {end - start} bytes (bytes {start}..{end})")


def _check_shard_headers(root: Path, weight_map: dict[str, str], index_file: Path, num_hidden_layers: int) -> None:
    """Every listed shard's header against the index: no tensor in two shards, no MTP or shared
    tensor outside the index, no truncated shard. Shards that do not exist are skipped here
    (a backbone-only shard may be left out; an MTP tensor mapped to a missing file is reported
    when it is read)."""
    holders: dict[str, list[str]] = {}
    for fname in sorted(set(weight_map.values())):
        path = root / fname
        if not os.path.exists(path):  # missing (or a link to nowhere): reported if an MTP tensor is read there
            continue
        for name in _shard_header(path):
            holders.setdefault(name, []).append(fname)
    for name, files in sorted(holders.items()):
        if len(files) > 1:
            raise CheckpointError(root / files[1], name, f"duplicated: {files[0]} holds a tensor of the same name "
                                  f"(the index maps it to {weight_map.get(name)}; vLLM reads every tensor of "
                                  "every shard and would load both)")
        if name not in weight_map and (name in SHARED or parse_layer_name(name, num_hidden_layers) is not None):
            raise CheckpointError(root / files[0], name, f"in this shard but not in {INDEX}: vLLM reads every "
                                  "tensor of every listed shard and would load it, the harness would not")


def _dt(d) -> str:
    return str(d).removeprefix("torch.")


def _st_dtype(s: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
            "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "U8": "uint8", "I8": "int8",
            "F8_E8M0": "float8_e8m0fnu", "BOOL": "bool", "I32": "int32", "I64": "int64",
            "I16": "int16"}.get(s, s)
