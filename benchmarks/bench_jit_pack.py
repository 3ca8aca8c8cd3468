"""A bare GPU host's time to its first verdict, with and without a packed JIT cache (a benchmark, not a test).

    python benchmarks/bench_jit_pack.py --out DIR --env 0.33.0=/tmp/vllm-0.33.0 --env 0.34.0=/tmp/vllm-0.34.0
        [--bundle 0.33.0=/tmp/parts-0.33.0 --bundle 0.34.0=/tmp/parts-0.34.0] [--tier] [--link-mb-s 100]

Per release (each under its environment's python, in the order given; every JIT cache root
is a new empty folder under DIR/<release>/, so each figure is a bare host's: no kernel, no
bytecode, no package map cached):
  pack          `warmup --lanes 4 --pack DIR/<release>/pack` into an empty root: the warmup's
                seconds, then the pack's parts, bytes and files (what a bundle carries)
  bare          `bisect-check` on an empty root: the first verdict without a pack
  restored      `warmup --restore PACK --restore-only` into the root it was packed from, emptied
                (FlashInfer's builds name their absolute paths), then `bisect-check`: the first
                verdict with the pack; what it compiled there is named (none: nothing compiled)
  refused       the OTHER release's pack restored here: it must be refused (one line naming
                the key fields) and leave the root's layers empty
  install       with --bundle REL=PARTS_DIR: `tools/offline-bundle/install.sh` into
                DIR/<release>/venv (a store of DIR's own; the base release first), whose python
                then runs the rest; its seconds count in both totals (else 'not measured')
  tier          with --tier: `.ci/gpu-tier` on an empty root, without and with the pack restored
                first (the full GPU tier from a bare host)
The transfer of the pack is estimated at --link-mb-s MB/s (printed as such: it depends on the link).
DIR/bench_jit_pack.json keeps every figure; the table printed at the end compares them.
Exit 0 measured, 1 a step failed (its log named), 2 bad arguments, 125 no GPU here (cannot judge).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET_FIRST_VERDICT_S = 90.0  # issue 43: bare host to first bisect-check verdict, install and transfer included
TARGET_TIER_S = 150.0  # the full GPU tier after install


def _pairs(flag: str, specs: list[str] | None) -> dict[str, pathlib.Path]:
    out = {}
    for spec in specs or ():
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ValueError(f"{flag} {spec}: want RELEASE=PATH")
        out[name] = pathlib.Path(path).resolve()
    return out


def _run(cmd: list[str], log: pathlib.Path, env: dict) -> tuple[int, float, str]:
    """(exit code, seconds, last output line) of ``cmd`` run from the repo root, its output in ``log``."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    secs = time.perf_counter() - t0
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return rc, secs, (lines[-1][:300] if lines else "")


def _layer_files(root: pathlib.Path) -> int:
    """Files (links included) in the cache root's packed layers (bytecode and package map aside)."""
    from harness.ci_speed.jit_pack import packed_layers

    return sum(len(files) for path in packed_layers(str(root)).values() for _, _, files in os.walk(path))


def _fresh(path: pathlib.Path) -> pathlib.Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def bench_release(name: str, python: pathlib.Path, out: pathlib.Path, env: dict, res: dict, failed: list,
                  tier: bool) -> None:
    r = res.setdefault(name, {})
    env = {**env, "PATH": f"{python.parent}{os.pathsep}{env.get('PATH', '')}"}
    py = str(python)

    def step(key, cmd, root, **extra):
        rc, secs, last = _run(cmd, out / f"{key}.log", {**env, "HYV4_JIT_CACHE": str(root)})
        r[key] = {"rc": rc, "seconds": round(secs, 1), "last_line": last, **extra}
        print(f"{name} {key}: exit {rc}, {secs:.1f} s: {last}", flush=True)
        if rc != 0:
            failed.append(f"{name} {key} (log {out / f'{key}.log'})")
        return rc

    pack = out / "pack"
    shutil.rmtree(pack, ignore_errors=True)
    if step("pack", [py, "-m", "harness", "warmup", "--lanes", "4", "--pack", str(pack)], _fresh(out / "jit-src")) == 0:
        from harness.ci_speed.jit_pack import read_manifest

        m = read_manifest(str(pack))
        parts = sorted(pack.glob("part.*"))
        r["pack"].update(parts=len(parts), bytes=sum(p.stat().st_size for p in parts), files=int(m.get("files", 0)),
                         key={f: m[f] for f in ("vllm", "flashinfer", "torch", "cuda", "capability")})
    step("bare", [py, "-m", "harness", "bisect-check", "--report", str(out / "bare.json")], _fresh(out / "jit-bare"))
    # restored into the root it was packed from, emptied first, as a fresh host restores into the
    # conventional /tmp/jit-VERSION: FlashInfer's ninja builds name their absolute paths and rebuild
    # under another root
    from harness.ci_speed.jit_cache import compiled_since, snapshot

    root = _fresh(out / "jit-src")
    step("restore", [py, "-m", "harness", "warmup", "--restore", str(pack), "--restore-only"], root)
    before = snapshot(str(root))
    step("restored", [py, "-m", "harness", "bisect-check", "--report", str(out / "restored.json")], root)
    built = compiled_since(before, snapshot(str(root)))
    r["restored"]["jit_files_compiled"] = sum(len(v) for v in built.values())
    r["restored"]["jit_compiled"] = built
    if tier:
        step("tier-bare", [str(ROOT / ".ci" / "gpu-tier"), str(out / "tier-bare")], _fresh(out / "jit-tier-bare"))
        root = _fresh(out / "jit-src")
        step("tier-restore", [py, "-m", "harness", "warmup", "--restore", str(pack), "--restore-only"], root)
        step("tier-restored", [str(ROOT / ".ci" / "gpu-tier"), str(out / "tier-restored")], root)


def refusals(releases: dict, outs: dict, env: dict, res: dict, failed: list) -> None:
    """Each release's pack restored under every other release: refused, nothing restored."""
    for name, python in releases.items():
        for other in releases:
            if other == name or not (outs[other] / "pack" / "MANIFEST").exists():
                continue
            root = _fresh(outs[name] / f"jit-refused-{other}")
            rc, secs, last = _run([str(python), "-m", "harness", "warmup", "--restore", str(outs[other] / "pack"),
                                   "--restore-only"], outs[name] / f"refused-{other}.log",
                                  {**env, "HYV4_JIT_CACHE": str(root)})
            ok = rc == 0 and "packed for another key" in last and _layer_files(root) == 0
            res[name][f"refused-{other}"] = {"rc": rc, "seconds": round(secs, 1), "last_line": last, "refused": ok}
            print(f"{name} refusing {other}'s pack: {'refused' if ok else 'NOT REFUSED'}: {last}", flush=True)
            if not ok:
                failed.append(f"{name} did not refuse {other}'s pack")


def install(bundles: dict, out: pathlib.Path, env: dict, res: dict, failed: list) -> dict[str, pathlib.Path]:
    """Each bundle installed into OUT/<release>/venv (one store for all: a delta finds its base); the pythons."""
    pythons = {}
    store = _fresh(out / "bundle-store")
    for name, parts in bundles.items():
        venv = out / name / "venv"
        (out / name).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(venv, ignore_errors=True)
        rc, secs, last = _run(["bash", str(ROOT / "tools" / "offline-bundle" / "install.sh"), str(parts), str(venv)],
                              out / name / "install.log",
                              {**env, "HYV4_BUNDLE_STORE": str(store),
                               "HYV4_JIT_CACHE": str(out / name / "jit-install")})
        res.setdefault(name, {})["install"] = {"rc": rc, "seconds": round(secs, 1), "last_line": last}
        print(f"{name} install: exit {rc}, {secs:.1f} s: {last}", flush=True)
        if rc != 0:
            failed.append(f"{name} install (log {out / name / 'install.log'})")
        pythons[name] = venv / "bin" / "python3"
    return pythons


def print_table(res: dict, link_mb_s: float) -> None:
    def sec(r, key):
        v = (r.get(key) or {}).get("seconds")
        return v if isinstance(v, (int, float)) and (r.get(key) or {}).get("rc") == 0 else None

    def cell(v):
        return "-" if v is None else f"{v:.1f} s"

    print()
    print(f"Bare host to first bisect-check verdict (target {TARGET_FIRST_VERDICT_S:.0f} s, install and transfer "
          f"included; transfer estimated at {link_mb_s:g} MB/s):")
    for name, r in res.items():
        if not isinstance(r, dict) or "bare" not in r:
            continue
        p = r.get("pack") or {}
        inst = sec(r, "install")
        mb = p.get("bytes", 0) / 1e6
        transfer = mb / link_mb_s if p.get("bytes") else None
        bare, restore, restored = sec(r, "bare"), sec(r, "restore"), sec(r, "restored")
        without = None if bare is None else bare + (inst or 0)
        with_ = None if None in (restore, restored, transfer) else restore + restored + transfer + (inst or 0)
        print(f"  vLLM {name}: pack {p.get('parts', '-')} parts, {mb:.1f} MB, {p.get('files', '-')} files "
              f"(key: {', '.join(f'{k} {v}' for k, v in (p.get('key') or {}).items())}); warmup that built it "
              f"{cell(sec(r, 'pack'))}")
        print(f"    install {cell(inst) if inst is not None else 'not measured (no --bundle)'}")
        print(f"    without the pack: bisect-check {cell(bare)}  -> first verdict {cell(without)}")
        print(f"    with the pack:    transfer ~{cell(transfer)} + restore {cell(restore)} + bisect-check "
              f"{cell(restored)}  -> first verdict {cell(with_)}"
              + (f"  ({with_ / without:.2f}x of without; "
                 f"target {'met' if with_ <= TARGET_FIRST_VERDICT_S else 'MISSED'})"
                 if with_ and without else ""))
        print(f"    JIT modules compiled by bisect-check after the restore: "
              f"{(r.get('restored') or {}).get('jit_files_compiled', '-')} (0: nothing compiled) "
              f"{(r.get('restored') or {}).get('jit_compiled') or ''}")
        for key, v in r.items():
            if key.startswith("refused-"):
                print(f"    {key[len('refused-'):]}'s pack here: {'refused' if v['refused'] else 'NOT REFUSED'}")
        if "tier-bare" in r:
            tb, tr, trr = sec(r, "tier-bare"), sec(r, "tier-restore"), sec(r, "tier-restored")
            with_tier = None if None in (tr, trr) else tr + trr
            print(f"    full GPU tier after install (target {TARGET_TIER_S:.0f} s): "
                  f"without the pack {cell(tb)}, with it {cell(with_tier)} (restore {cell(tr)})"
                  + (f"  ({with_tier / tb:.2f}x)" if tb and with_tier else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--env", action="append", default=[], metavar="RELEASE=ENV_DIR")
    ap.add_argument("--bundle", action="append", default=[], metavar="RELEASE=PARTS_DIR",
                    help="install each release from its bundle parts first (timed) and measure in that venv")
    ap.add_argument("--tier", action="store_true", help="also the full GPU tier, without and with the pack")
    ap.add_argument("--link-mb-s", type=float, default=100.0, help="MB/s the pack's transfer is estimated at")
    a = ap.parse_args(argv)
    try:
        envs, bundles = _pairs("--env", a.env), _pairs("--bundle", a.bundle)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not envs and not bundles:
        print("error: give --env RELEASE=ENV_DIR or --bundle RELEASE=PARTS_DIR (one per release)", file=sys.stderr)
        return 2
    for name, env_dir in envs.items():
        if name not in bundles and not (env_dir / "bin" / "python3").exists():
            print(f"error: --env {name}={env_dir}: no {env_dir}/bin/python3", file=sys.stderr)
            return 2
    if not (a.link_mb_s > 0):
        print(f"error: --link-mb-s {a.link_mb_s}: give a positive number", file=sys.stderr)
        return 2
    from harness.production.can_run import gpu_device_nodes

    if not gpu_device_nodes():
        print("cannot judge: no NVIDIA GPU device here; bench_jit_pack.py measures a GPU host's first verdict")
        return 125
    out = pathlib.Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    res_path = out / "bench_jit_pack.json"
    res: dict = {}
    failed: list[str] = []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONUNBUFFERED="1", HYV4_ENGINE_KV_CACHE_GIB=os.environ.get("HYV4_ENGINE_KV_CACHE_GIB", "4"))
    pythons = {name: env_dir / "bin" / "python3" for name, env_dir in envs.items()}
    pythons.update(install(bundles, out, env, res, failed))
    outs = {}
    for name, python in pythons.items():
        outs[name] = out / name
        outs[name].mkdir(parents=True, exist_ok=True)
        bench_release(name, python, outs[name], env, res, failed, a.tier)
        res_path.write_text(json.dumps(res, indent=1))
    refusals(pythons, outs, env, res, failed)
    res_path.write_text(json.dumps(res, indent=1))
    print_table(res, a.link_mb_s)
    for f in failed:
        print(f"failed: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
