"""Does the loader read only the MTP tensors? A checkpoint with a multi-GiB fake backbone.

Builds a synthetic HY V4 MTP checkpoint and adds backbone tensors whose data
are sparse holes (``truncate``; no disk space used):

* a backbone-only shard (``--backbone-gib``, default 8 GiB) that the index
  maps backbone tensors to: the loader must never open it;
* a mixed shard holding a ``--mixed-gib`` (default 2 GiB) backbone tensor
  *before* the MTP tensors of that shard: the loader opens it but must touch
  only the MTP tensors' bytes.

Then ``load_checkpoint`` runs and the script prints what it read
(``/proc/self/io`` rchar / read_bytes, page faults) and its peak RSS growth
(VmHWM reset through ``/proc/self/clear_refs``), each as a ratio to the bytes
the MTP tensors take in the checkpoint. The canonical weights are float64, so
peak RSS is expected near 4x (bf16) to 8x (FP8) the stored MTP bytes, plus
transients; a loader that touched the backbone would show ratios in the
hundreds.

    ./with-env python benchmarks/bench_checkpoint_stream.py [--preset small] [--quant fp8]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors import safe_open

from harness.checkpoint.loader import load_checkpoint
from harness.checkpoint.synth import synth_config, write_synthetic
from reference.config import MTPConfig
from reference.weights import random_weights

GIB = 1 << 30
_ST = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "F8_E8M0": 1, "F64": 8}


def _write_st(path: Path, entries: list[tuple[str, str, list[int], bytes | None]]) -> int:
    """A safetensors file; an entry with data None is a hole of its declared size. Returns data bytes."""
    header, off = {}, 0
    for name, dtype, shape, data in entries:
        n = _ST[dtype]
        for d in shape:
            n *= d
        if data is not None and len(data) != n:
            raise ValueError(name)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        base = f.tell()
        for name, _, _, data in entries:
            if data is not None:
                f.seek(base + header[name]["data_offsets"][0])
                f.write(data)
        f.truncate(base + off)  # holes stay holes
    return off


def build(root: Path, preset: str, quant: str, backbone_gib: float, mixed_gib: float) -> tuple[Path, int, int]:
    hf = synth_config(preset)
    hf["num_hidden_layers"] = 4
    hf["layer_types"] = ["deepseek_sparse_attention"] * 4
    hf["mlp_layer_types"] = ["dense"] + ["sparse"] * 3
    cfg = MTPConfig.from_hf_dict(hf)
    d = write_synthetic(root / "ckpt", hf, random_weights(cfg, 0), quant=quant, experts="fused", shards=2)
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    wm = idx["weight_map"]
    mtp_bytes = 0
    # rewrite shard 2 with a backbone hole in front of its MTP tensors
    shard2 = sorted(set(wm.values()))[-1]
    entries = []
    h = hf["hidden_size"]
    big_rows = max(1, int(mixed_gib * GIB) // (2 * h))
    entries.append(("model.layers.0.mlp.down_proj.weight", "BF16", [h, big_rows], None))
    with safe_open(str(d / shard2), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            sl = f.get_slice(name)
            entries.append((name, sl.get_dtype(), list(sl.get_shape()), t.contiguous().view(-1).view(
                __import__("torch").uint8).numpy().tobytes()))
    _write_st(d / shard2, entries)
    wm["model.layers.0.mlp.down_proj.weight"] = shard2
    # a backbone-only shard
    rows = max(1, int(backbone_gib * GIB) // (2 * h) // 4)
    bb = [(f"model.layers.{k}.mlp.gate_up_proj.weight", "BF16", [rows, h], None) for k in range(1, 4)]
    bb.append(("model.norm.weight", "BF16", [h], None))
    bb.append(("model.layers.1.self_attn.o_proj.weight", "BF16", [h, rows], None))
    backbone = _write_st(d / "model-backbone.safetensors", bb)
    for name, *_ in bb:
        wm[name] = "model-backbone.safetensors"
    idx_path.write_text(json.dumps(idx, indent=1))
    for name, fname in wm.items():
        if fname == "model-backbone.safetensors" or name == "model.layers.0.mlp.down_proj.weight":
            continue
        with safe_open(str(d / fname), "pt") as f:
            sl = f.get_slice(name)
            n = _ST[sl.get_dtype()]
            for k in sl.get_shape():
                n *= k
            mtp_bytes += n
    return d, mtp_bytes, backbone + big_rows * 2 * h


def _io() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            k, v = line.split(":")
            out[k] = int(v)
    except OSError:
        pass
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out["faults"] = ru.ru_minflt + ru.ru_majflt
    return out


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _drop_cache(d: Path) -> None:
    for p in d.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)


def measure(d: Path) -> dict:
    """Load ``d`` in this (fresh) process and return what it read and its peak RSS growth."""
    _drop_cache(d)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    except OSError:
        pass
    rss0, io0 = _status("VmRSS"), _io()
    t0 = time.perf_counter()
    loaded = load_checkpoint(d)
    load_s = time.perf_counter() - t0
    io1, hwm = _io(), _status("VmHWM")
    return {"load_s": load_s, "files_read": loaded.files_read, "tensors": len(loaded.weights),
            "canonical_bytes": sum(t.numel() * t.element_size() for t in loaded.weights.values()),
            "rchar": io1.get("rchar", 0) - io0.get("rchar", 0),
            "read_bytes": io1.get("read_bytes", 0) - io0.get("read_bytes", 0),
            "touched": (io1["faults"] - io0["faults"]) * resource.getpagesize(),
            "peak_rss_growth": max(hwm - rss0, 0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small", choices=("tiny", "small", "real-dims"))
    ap.add_argument("--quant", default="fp8", choices=("bf16", "fp8", "fp8-ue8m0"))
    ap.add_argument("--backbone-gib", type=float, default=8.0)
    ap.add_argument("--mixed-gib", type=float, default=2.0)
    ap.add_argument("--measure", metavar="DIR", help=argparse.SUPPRESS)  # the child process
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(Path(args.measure))))
        return 0
    import subprocess

    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        t0 = time.perf_counter()
        d, mtp_bytes, backbone_bytes = build(Path(tmp), args.preset, args.quant, args.backbone_gib, args.mixed_gib)
        disk = sum(p.stat().st_blocks * 512 for p in d.iterdir())
        build_s = time.perf_counter() - t0
        # a fresh process, so that the build's freed memory does not hide the load's RSS
        out = subprocess.run([sys.executable, __file__, "--measure", str(d)], check=True,
                             capture_output=True, text=True).stdout
        m = json.loads(out.strip().splitlines()[-1])
        canon, rchar, rbytes = m["canonical_bytes"], m["rchar"], m["read_bytes"]
        touched, peak = m["touched"], m["peak_rss_growth"]
        print(f"checkpoint: preset {args.preset}, quant {args.quant}, {m['tensors']} canonical tensors, "
              f"files read {m['files_read']}")
        print(f"MTP tensor bytes (stored)   {mtp_bytes / 2**20:10.2f} MiB")
        print(f"backbone bytes (holes)      {backbone_bytes / 2**20:10.2f} MiB  (on disk for the whole "
              f"checkpoint: {disk / 2**20:.2f} MiB)")
        print(f"canonical float64 bytes     {canon / 2**20:10.2f} MiB")
        print(f"load time                   {m['load_s']:10.3f} s   (build {build_s:.1f} s)")
        print(f"rchar (read syscalls)       {rchar / 2**20:10.2f} MiB  ratio {rchar / mtp_bytes:7.3f}")
        print(f"read_bytes (block device)   {rbytes / 2**20:10.2f} MiB  ratio {rbytes / mtp_bytes:7.3f}")
        print(f"page faults x page size     {touched / 2**20:10.2f} MiB  ratio {touched / mtp_bytes:7.3f}")
        print(f"peak RSS growth             {peak / 2**20:10.2f} MiB  ratio {peak / mtp_bytes:7.3f}"
              f"  (float64 canonical / stored = {canon / mtp_bytes:.2f})")
        ok = "model-backbone.safetensors" not in m["files_read"] and peak < backbone_bytes / 10
        print("backbone untouched:", "yes" if ok else "NO")
        return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
