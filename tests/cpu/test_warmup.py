"""``python -m harness warmup`` and the JIT cache root, on CPU: flags, the exit contract, packing."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from harness import case_registry
from harness.ci_speed import jit_cache, startup_gc
from harness.cli import main
from harness.production import can_run

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def no_jit_cache(monkeypatch):
    """No JIT cache root in the environment, and what the test's ``apply_jit_cache`` sets is undone
    at its end: the cache root, every layer's variable, CUDA_CACHE_MAXSIZE, PYTHONDONTWRITEBYTECODE and
    the process's bytecode switch. (``monkeypatch.delenv`` of an unset variable records nothing to
    restore: each variable is set first, so its absence is restored too. A leaked
    PYTHONPYCACHEPREFIX made every later process of the worker recompile torch into a temporary
    directory, a leaked $HYV4_JIT_CACHE pointed its later commands at it.)"""
    for var in (*jit_cache.JIT_CACHE_LAYOUT, jit_cache.JIT_CACHE_ENV, "CUDA_CACHE_MAXSIZE", "PYTHONDONTWRITEBYTECODE",
                jit_cache.HUMMING_BG_BUILD_VAR):
        was = os.environ.get(var)
        monkeypatch.setenv(var, was or "")
        if was is None or var in (*jit_cache.JIT_CACHE_LAYOUT, jit_cache.JIT_CACHE_ENV, jit_cache.HUMMING_BG_BUILD_VAR):
            monkeypatch.delenv(var)
    monkeypatch.setattr(sys, "pycache_prefix", sys.pycache_prefix)  # the bytecode switch is per process
    monkeypatch.setattr(sys, "dont_write_bytecode", sys.dont_write_bytecode)
    import importlib.metadata  # and the package-map layer (jit_cache.memoize_packages_distributions)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", importlib.metadata.packages_distributions)


@pytest.mark.parametrize("argv, culprit", [
    (["--case", "no-such-case"], "--case no-such-case"),
    (["--engine", "no-such-engine"], "--engine no-such-engine"),
    (["--pack", "x.tar.gz"], "--pack needs one cache root"),
    (["--if-cold"], "--if-cold needs one cache root"),
    (["--report", "/no/such/dir/r.json"], "--report /no/such/dir/r.json"),
])
def test_bad_flags_exit_2_naming_the_flag(argv, culprit, capsys, no_jit_cache):
    assert main(["warmup", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0] and "Traceback" not in err[0]


def test_no_gpu_is_cannot_judge_and_nothing_packed(tmp_path, capsys, no_jit_cache):
    if can_run.cannot_run_production_reason() is None:
        pytest.skip("a GPU with vLLM is present: warmup would run")
    dest = tmp_path / "jit.tar.gz"
    assert main(["warmup", "--cache", str(tmp_path / "cache"), "--case", "tiny-k1", "--pack", str(dest)]) == 125
    cap = capsys.readouterr()
    assert "warmup: " in cap.out + cap.err and "Traceback" not in cap.out + cap.err
    assert not dest.exists()


def test_cache_root_points_every_layer_and_the_user_wins(tmp_path, monkeypatch, no_jit_cache):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert jit_cache.apply_jit_cache() == {}  # no root: the libraries keep their defaults
    monkeypatch.setenv("TRITON_CACHE_DIR", "/mine")
    done = jit_cache.apply_jit_cache(str(tmp_path))
    assert os.environ["TRITON_CACHE_DIR"] == "/mine" and "TRITON_CACHE_DIR" not in done
    assert set(done) == set(jit_cache.JIT_CACHE_LAYOUT) - {"TRITON_CACHE_DIR"} | {jit_cache.HUMMING_BG_BUILD_VAR}
    assert os.environ[jit_cache.HUMMING_BG_BUILD_VAR] == "1"  # humming's background builds off
    assert all(os.environ[v] == str(tmp_path / sub) for v, sub in jit_cache.JIT_CACHE_LAYOUT.items()
               if v != "TRITON_CACHE_DIR")
    assert os.environ[jit_cache.JIT_CACHE_ENV] == str(tmp_path)
    assert sys.pycache_prefix == str(tmp_path / "pycache") and not sys.dont_write_bytecode
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    import importlib.metadata
    assert importlib.metadata.packages_distributions._hyv4_memo_of is not None  # the package-map layer


def test_humming_background_builds_follow_the_switch_and_the_user_wins(tmp_path, monkeypatch, no_jit_cache):
    """The installed humming starts each background build (a Python subprocess per import) only
    while ``HUMMING_DISABLE_PARALLEL_BUILD`` is not "1", and builds what is missing on first use
    either way: read from its sources (importing it costs a torch import). A value the user set
    is kept."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("humming")
    if spec is None:
        pytest.skip("humming is not installed here")
    pkg = os.path.dirname(spec.origin)
    bg = {}
    for rel in ("ops/utils.py", "utils/nvrtc.py"):
        with open(os.path.join(pkg, rel)) as f:
            text = f.read()
        for name, body in re.findall(r"^def (\w+_in_bg)\(\):\n((?:    .*\n|\n)+)", text, re.M):
            bg[name] = body
            assert body.lstrip().startswith(f'if os.getenv("{jit_cache.HUMMING_BG_BUILD_VAR}", "0") == "1":'), name
            assert "return None" in body.split("\n")[1], name  # the switch returns before the spawn
    assert len(bg) == 2, f"humming's background builds: {sorted(bg)}"
    monkeypatch.setenv(jit_cache.HUMMING_BG_BUILD_VAR, "0")
    done = jit_cache.apply_jit_cache(str(tmp_path))
    assert jit_cache.HUMMING_BG_BUILD_VAR not in done and os.environ[jit_cache.HUMMING_BG_BUILD_VAR] == "0"


def test_package_map_layer_answers_as_importlib_and_follows_installs(tmp_path, monkeypatch, no_jit_cache):
    """``packages_distributions()`` through the layer: importlib's own answer, read back from the
    layer as the same dict (order included) without recomputing, and recomputed once the
    installed distributions change (a new ``*.dist-info`` on ``sys.path``) or the layer's file
    cannot be read. (importlib's answer is computed once here: ~0.6 s of CPU each time.)"""
    import importlib.metadata as md

    compute = md.packages_distributions
    calls = []

    def counted():
        calls.append(1)
        return compute() if len(calls) == 1 else {"stand_in_pkg": ["stand-in-dist"], "n": [str(len(calls))]}

    monkeypatch.setattr(md, "packages_distributions", counted)
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    layer = tmp_path / "layer"
    jit_cache.memoize_packages_distributions(str(layer))
    jit_cache.memoize_packages_distributions(str(layer))  # once per process: not wrapped twice
    first = md.packages_distributions()
    assert len(calls) == 1 and len(first) > 10 and "torch" in first
    assert len(list(layer.glob("packages_distributions-*.json"))) == 1
    again = md.packages_distributions()
    assert len(calls) == 1 and list(again.items()) == list(first.items())  # from the layer, same order

    (site / "stand_in_dist-1.0.dist-info").mkdir()  # an install changes the key: computed again
    after = md.packages_distributions()
    assert len(calls) == 2 and after == {"stand_in_pkg": ["stand-in-dist"], "n": ["2"]}
    assert len(list(layer.glob("packages_distributions-*.json"))) == 2
    assert md.packages_distributions() == after and len(calls) == 2

    for f in layer.glob("*.json"):  # an unreadable layer costs the time, not the answer
        f.write_text("{not json")
    assert md.packages_distributions() == {"stand_in_pkg": ["stand-in-dist"], "n": ["3"]} and len(calls) == 3


def test_gc_deferral_is_the_program_start_only(monkeypatch):
    """``python -m harness`` pauses the cyclic GC for its imports and resumes it (frozen) when a
    model is about to be built (the production path's ``vllm_imported`` point, which names no
    ci_speed module); ``end_gc_deferral`` touches nothing it did not pause, and a test calling
    ``cli.main`` in process does not pause it."""
    import gc

    from harness.production import run_hooks

    monkeypatch.setattr(startup_gc, "_GC_DEFERRED", False)
    monkeypatch.setattr(run_hooks, "_hooks", {point: [] for point in run_hooks.POINTS})
    was = gc.isenabled()
    try:
        gc.enable()
        startup_gc.defer_gc()
        assert not gc.isenabled()
        frozen = gc.get_freeze_count()
        run_hooks.fire("vllm_imported")  # as ProductionSession and the engine's build_llm do
        assert gc.isenabled() and gc.get_freeze_count() > frozen  # what the imports made is frozen
        gc.disable()  # paused by someone else (the speed plugin while collecting): left so
        startup_gc.end_gc_deferral()
        assert not gc.isenabled()
        gc.enable()
        assert main(["warmup", "--case", "no-such-case"]) == 2  # the whole of cli.main, in process
        assert gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()


def test_bytecode_lands_under_the_root_in_the_process_and_its_children(tmp_path):
    """A host with PYTHONDONTWRITEBYTECODE (as some GPU hosts set) still caches bytecode once a cache
    root is applied: in the process that applied it and in the processes it starts."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("parent_mod", "child_mod"):
        (src / f"{name}.py").write_text("X = 1\n")
    code = ("import subprocess, sys\n"
            "from harness.ci_speed.jit_cache import apply_jit_cache\n"
            "apply_jit_cache()\n"
            "import parent_mod\n"
            "sys.exit(subprocess.call([sys.executable, '-c', 'import child_mod']))\n")
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", jit_cache.JIT_CACHE_ENV: str(root),
           "PYTHONPATH": os.pathsep.join([str(src), str(ROOT)])}
    for var in jit_cache.JIT_CACHE_LAYOUT:
        env.pop(var, None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    cached = sorted(p.name.split(".")[0] for p in (root / "pycache").rglob("*.pyc"))
    assert "parent_mod" in cached and "child_mod" in cached
    assert not any(src.rglob("*.pyc"))  # nothing beside the sources


@pytest.mark.parametrize("module, argv", [
    ("harness", ["main"]),
    ("harness", ["engine", "--rejudge", "{tmp}"]),  # its arguments are checked without torch: a run
    ("harness", ["side-by-side"]),
    ("harness", ["goldens", "list"]),
])
def test_entry_points_cache_bytecode_before_torch_is_imported(tmp_path, module, argv):
    """Every documented entry point applies $HYV4_JIT_CACHE before torch is first imported: a
    module imported before ``sys.pycache_prefix`` is set is compiled from source on every run
    (on a host that sets PYTHONDONTWRITEBYTECODE and ships torch without .pyc files, that was
    ~1200 torch modules per ``python -m harness main``). The child stops at torch's import."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    pkg = tmp_path / "src" / "stand_in_pkg"  # stands for torch / vLLM / transformers in the precompile
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    code = ("import os, runpy, sys\n"
            "from harness.ci_speed import jit_cache\n"
            "jit_cache.PRECOMPILE_PACKAGES, jit_cache.PRECOMPILE_MIN_CPUS = ('stand_in_pkg',), 1\n"
            "class Stop:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'torch':\n"
            "            pre = os.path.join(sys.pycache_prefix or '', jit_cache.PRECOMPILED)\n"
            "            print('PREFIX', sys.pycache_prefix, sys.dont_write_bytecode, os.path.exists(pre),"
            " flush=True)\n"
            "            os._exit(0)\n"
            "sys.meta_path.insert(0, Stop())\n"
            f"sys.argv = [{module!r}, *{argv!r}]\n"
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)\n")
    root = tmp_path / "root"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", jit_cache.JIT_CACHE_ENV: str(root),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path / "src")])}
    for var in jit_cache.JIT_CACHE_LAYOUT:
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    precompiled = argv == ["main"]  # the commands with their own parser (engine, ...) leave it to their callers
    assert f"PREFIX {root / 'pycache'} False {precompiled}" in out.stdout, \
        (module, out.stdout[-500:], out.stderr[-1500:])


def test_precompile_fills_a_cold_bytecode_layer_once(tmp_path, monkeypatch):
    """A cold bytecode layer on a many-core host: every source of the named packages compiled into
    the layer at once, a marker per package directory and Python; nothing again once done, nothing
    without a layer or below the core count, a package that is not installed skipped."""
    pkg = tmp_path / "src" / "stand_in_pkg"
    (pkg / "sub").mkdir(parents=True)
    for f in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / f).write_text("X = 1\n")
    (pkg / "broken.py").write_text("def (:\n")  # left to the import that needs it
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=1) == []  # no layer
    layer = tmp_path / "layer"
    monkeypatch.setattr(sys, "pycache_prefix", str(layer))
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=10 ** 6) == []  # too few cores
    assert jit_cache.precompile_bytecode(("stand_in_pkg", "no_such_pkg_hyv4"), min_cpus=1) == [str(pkg)]
    compiled = sorted(p.name.split(".")[0] for p in (layer / str(pkg).lstrip(os.sep)).rglob("*.pyc"))
    assert compiled == ["__init__", "__init__", "a", "b"] and not any(pkg.rglob("*.pyc"))
    assert json.loads((layer / jit_cache.PRECOMPILED).read_text()) == {str(pkg): sys.version}
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=1) == []  # done before
    (layer / jit_cache.PRECOMPILED).write_text(json.dumps({str(pkg): "another Python"}))
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=1) == [str(pkg)]
    # Python 3.12 gives Path search locations for a pathlib.Path on sys.path (3.11 ignores such an
    # entry): the marker still records strings (a GPU tier run failed on json.dump of a PosixPath)
    import importlib.machinery
    import importlib.util
    spec = importlib.machinery.ModuleSpec("stand_in_pkg", None, is_package=True)
    spec.submodule_search_locations = [pkg]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == "stand_in_pkg" else None)
    (layer / jit_cache.PRECOMPILED).unlink()
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=1) == [str(pkg)]
    assert json.loads((layer / jit_cache.PRECOMPILED).read_text()) == {str(pkg): sys.version}
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    monkeypatch.setattr(sys, "pycache_prefix", str(blocked / "pycache"))  # a layer that cannot be written
    assert jit_cache.precompile_bytecode(("stand_in_pkg",), min_cpus=1) == []


def test_pack_holds_the_layout_and_restores(tmp_path):
    """A pack holds every JIT layer of the layout but the host's own (bytecode, package map), and
    nothing else under the root; restored elsewhere, each layer's file is back (the round trip of
    links, folders and modes: tests/cpu/test_jit_pack.py)."""
    from harness.ci_speed import jit_pack

    root = tmp_path / "cache"
    for i, sub in enumerate(jit_cache.JIT_CACHE_LAYOUT.values()):
        (root / sub / "k").mkdir(parents=True)
        (root / sub / "k" / "kernel.so").write_bytes(bytes([i]) * 100)
    (root / "unrelated").mkdir()
    (root / "unrelated" / "x").write_text("not a JIT layer")
    key = {f: "1" for f in jit_pack.KEY_FIELDS}
    meta = jit_pack.write_pack(str(root), str(tmp_path / "pack"), key)
    assert meta["parts"] == "1" and int(meta["bytes"]) == (tmp_path / "pack" / "part.00").stat().st_size
    assert jit_pack.restore(str(tmp_path / "pack"), str(tmp_path / "restored"), key)[0] == "restored"
    packed = {var: sub for var, sub in jit_cache.JIT_CACHE_LAYOUT.items() if var not in jit_pack.NOT_PACKED}
    names = {str(p.relative_to(tmp_path / "restored")) for p in (tmp_path / "restored").rglob("kernel.so")}
    assert names == {f"{sub}/k/kernel.so" for sub in packed.values()}  # bytecode stays on its host
    for i, (var, sub) in enumerate(jit_cache.JIT_CACHE_LAYOUT.items()):
        if var in packed:
            assert (tmp_path / "restored" / sub / "k" / "kernel.so").read_bytes() == bytes([i]) * 100
    assert not (tmp_path / "restored" / "pycache").exists()
    assert not (tmp_path / "restored" / "unrelated").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "pack", "restored"]  # no temp left


# tests/cpu/conftest.py runs them in the xdist worker that imports vLLM anyway: the engine arguments,
# and the prefetch programs' imports (vllm.utils.flashinfer, vLLM's sampler, flashinfer: ~19 s of CPU in
# a worker without vLLM, ~4 s in one that has imported vLLM's MTP model already)
VLLM_IN_PROCESS = {"test_engine_arguments_are_vllms_and_the_kv_size_is_fixed_on_request",
                   "test_each_prefetch_names_what_the_installed_vllm_and_flashinfer_hold"}


@pytest.mark.parametrize("gib", [None, "4", "0.5"])
def test_engine_arguments_are_vllms_and_the_kv_size_is_fixed_on_request(gib, monkeypatch, tmp_path):
    """``engine_kwargs`` names only fields of vLLM 0.33's ``EngineArgs`` (a renamed or removed
    argument would otherwise surface only on a GPU host), and ``HYV4_ENGINE_KV_CACHE_GIB`` (set by
    .ci/gpu-tier when workers share a GPU) turns into vLLM's ``kv_cache_memory_bytes``."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    engine_cases = case_registry.specs(kind="engine")
    from harness.production.engine.session import ENGINE_KV_GIB_ENV, engine_kwargs

    if gib is None:
        monkeypatch.delenv(ENGINE_KV_GIB_ENV, raising=False)
    else:
        monkeypatch.setenv(ENGINE_KV_GIB_ENV, gib)
    kw = engine_kwargs(str(tmp_path), next(iter(engine_cases.values())))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    assert set(kw) <= fields, sorted(set(kw) - fields)
    if gib is None:
        assert "kv_cache_memory_bytes" not in kw
        assert kw["gpu_memory_utilization"] == 0.3
    else:
        assert kw["kv_cache_memory_bytes"] == int(float(gib) * 2**30)
        # only vLLM's start-up free-memory check reads it then: 14 GiB of a 141 GiB GPU, not 42
        assert kw["gpu_memory_utilization"] == 0.1
    EngineArgs(**kw)  # the dataclass takes them as given (no engine is built)


def test_the_stamp_skips_only_what_was_warmed_for_these_versions(tmp_path):
    """``--if-cold``: a step is skipped only when the cache root's stamp holds it for the same
    torch/CUDA/vLLM/GPU and the same case definition; anything else runs again."""
    import dataclasses

    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.ci_speed.warm_stamp import STAMP, cold_steps, fingerprint, read_stamp, write_stamp

    a, b = gpu_cases["tiny-k1"], gpu_cases["tiny-k3-share"]
    wanted = {"tiny-k1": fingerprint(a), "tiny-k3-share": fingerprint(b)}
    h200 = {"torch": "2.11.0+cu130", "vllm": "0.33.0", "cuda": "13.0", "gpu": "NVIDIA H200"}
    assert read_stamp(str(tmp_path)) == {}
    assert cold_steps(wanted, {}, h200) == wanted  # nothing stamped: everything runs
    write_stamp(str(tmp_path), h200, {"tiny-k1": wanted["tiny-k1"]})
    stamp = read_stamp(str(tmp_path))
    assert cold_steps(wanted, stamp, h200) == {"tiny-k3-share": wanted["tiny-k3-share"]}
    assert cold_steps(wanted, stamp, {**h200, "vllm": "0.34.0"}) == wanted  # another vLLM: all cold
    changed = {**wanted, "tiny-k1": fingerprint(dataclasses.replace(a, tokens=a.tokens + 1))}
    assert cold_steps(changed, stamp, h200) == changed  # a case with other shapes: cold again
    from harness.ci_speed import jit_cache
    with pytest.MonkeyPatch.context() as mp:  # a layer added to the root: what went elsewhere is not warm
        mp.setitem(jit_cache.JIT_CACHE_LAYOUT, "SOME_NEW_CACHE_DIR", "some-new-layer")
        assert cold_steps({"tiny-k1": fingerprint(a)}, stamp, h200) == {"tiny-k1": fingerprint(a)}
    from harness.ci_speed import warm_stamp
    with pytest.MonkeyPatch.context() as mp:  # a step now leaves more in the root: warmed before, it is cold
        mp.setattr(warm_stamp, "STEP_LEAVES", [*warm_stamp.STEP_LEAVES, "something-new"])
        assert cold_steps({"tiny-k1": fingerprint(a)}, stamp, h200) == {"tiny-k1": fingerprint(a)}
    write_stamp(str(tmp_path), h200, {"tiny-k3-share": wanted["tiny-k3-share"]})
    assert cold_steps(wanted, read_stamp(str(tmp_path)), h200) == {}  # stamps accumulate
    write_stamp(str(tmp_path), {**h200, "gpu": "NVIDIA B200"}, {"tiny-k1": wanted["tiny-k1"]})
    assert read_stamp(str(tmp_path))["steps"] == {"tiny-k1": wanted["tiny-k1"]}  # other versions replace it
    (tmp_path / STAMP).write_text("{not json")
    assert read_stamp(str(tmp_path)) == {}  # unreadable: nothing counts as warm


def test_lanes_put_the_lead_first_and_each_kernel_family_in_its_own_process():
    """``--lanes``: the first bf16 case alone, then FP8 checkpoints, the engine, real dims and
    the other bf16 cases (their cold costs in that order) spread over the lanes; every wanted
    step lands in exactly one place."""
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.ci_speed.warmup import DEFAULT_ENGINE_CASE, plan_lanes

    cases = list(gpu_cases)
    lead, lanes = plan_lanes(cases, DEFAULT_ENGINE_CASE, 4)
    assert lead == "tiny-k1" and len(lanes) == 4
    fp8 = [c for c in cases if gpu_cases[c].quant != "bf16"]
    assert lanes[0] == {"cases": fp8, "engines": []} and lanes[1] == {"cases": [], "engines": [DEFAULT_ENGINE_CASE]}
    assert lanes[2]["cases"] == ["real-dims-k2"]
    placed = [c for lane in lanes for c in lane["cases"]]
    assert sorted([lead, *placed]) == sorted(cases)
    lead2, two = plan_lanes(cases, DEFAULT_ENGINE_CASE, 2)  # fewer lanes: families share them
    assert lead2 == lead and len(two) == 2 and two[1]["engines"] == [DEFAULT_ENGINE_CASE]
    assert sorted(c for lane in two for c in lane["cases"]) == sorted(placed)
    assert plan_lanes(["tiny-k2-fp8-split-long"], None, 4) == (None, [{"cases": ["tiny-k2-fp8-split-long"],
                                                                       "engines": []}])


def test_the_default_warmup_builds_every_cuda_graph_engine_case():
    """A graph case's capture, torch.compile and draft-decode kernels are built by no eager engine:
    the default warmup builds the eager engine case, every bisect-check engine case and every graph-mode engine case,
    each its own family (its own lane when lanes allow), so no tier, bisect or mutant run compiles after it."""
    import argparse

    from harness.ci_speed.warmup import DEFAULT_ENGINE_CASE, _lane_command, engines_of, plan_lanes
    engine_cases = case_registry.specs(kind="engine")

    args = argparse.Namespace(engine=None, no_engine=False)
    engines = engines_of(args)
    graphs = [c for c, spec in engine_cases.items() if spec.graphs]
    assert engines[0] == DEFAULT_ENGINE_CASE and set(graphs) <= set(engines) and len(graphs) >= 3
    # every engine case bisect-check runs (with --graphs too): the two-MTP-layer bisect case runs
    # vLLM's multi-module speculator, whose Triton input kernels no one-layer case builds
    bisect = {*case_registry.ids(role="bisect", kind="engine"), *case_registry.ids(role="graph-bisect", kind="engine")}
    assert bisect <= set(engines)
    assert any(engine_cases[e].overrides and dict(engine_cases[e].overrides).get("num_nextn_predict_layers") == 2
               for e in engines)
    # a graph-mode reload case is warmed (its own drafter options: a model no other case compiles),
    # through the engine's reload path (_warm_engine; run_case refuses it)
    assert any(engine_cases[e].reload_seed is not None for e in graphs)
    _, lanes = plan_lanes(["tiny-k1", "tiny-k3-share"], engines, 8)
    assert sorted(e for lane in lanes for e in lane["engines"]) == sorted(engines)
    assert all(len(lane["engines"]) <= 1 for lane in lanes)
    assert engines_of(argparse.Namespace(engine=["engine-tiny-k2", "engine-tiny-k2"], no_engine=False)) == \
        ["engine-tiny-k2"]
    assert engines_of(argparse.Namespace(engine=None, no_engine=True)) == []
    cmd = _lane_command([], graphs[:2], "r.json")
    assert cmd[-5:] == ["--engine-only", "--engine", graphs[0], "--engine", graphs[1]]


@pytest.mark.parametrize("argv, culprit", [
    (["--engine-only", "--case", "tiny-k1"], "--engine-only and --case"),
    (["--lanes", "0"], "--lanes 0"),
    (["--engine-only", "--no-engine"], "--engine-only and --no-engine"),
    (["--mutants-only", "--case", "tiny-k1"], "--mutants-only and --case"),
    (["--mutants-only", "--engine-only"], "--mutants-only and --engine-only"),
    (["--mutants-only", "--engine", "engine-tiny-k2"], "--mutants-only and --engine"),
])
def test_lane_flags_are_checked(argv, culprit, capsys):
    assert main(["warmup", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and culprit in err[0]


@pytest.fixture(scope="module")
def failed_lanes_beside_a_slow_prefetch():
    """One real ``run_lanes`` on a CPU host, shared by the two tests below (each lane is a
    ``python -m harness warmup`` process importing torch: ~4.5 s of CPU): the engine-only lane
    and an FP8 case's lane, both exiting 125 here, beside a prefetch that would sleep 120 s
    -> (the CannotJudge raised, or None, and the seconds run_lanes took)."""
    if can_run.cannot_run_production_reason() is None:
        pytest.skip("a GPU with vLLM is present: the lanes would warm")
    import time

    from harness.ci_speed import warmup
    from harness.exitcodes import CannotJudge

    lanes = [{"cases": [], "engines": [warmup.DEFAULT_ENGINE_CASE]},
             {"cases": ["tiny-k2-fp8-split-long"], "engines": []}]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(warmup.PREFETCH, "slow", (lambda cases, engine: True, "import time; time.sleep(120)"))
        t0 = time.perf_counter()
        try:
            warmup.run_lanes(None, lanes, prefetch=["slow"])
            raised = None
        except CannotJudge as exc:
            raised = exc
        return raised, time.perf_counter() - t0


def test_lanes_are_real_warmup_processes_and_a_failed_one_is_named(failed_lanes_beside_a_slow_prefetch):
    """The lane commands are ``python -m harness warmup`` with flags it accepts: here (no CUDA)
    every lane exits 125 and the first is named with its steps and its last line."""
    from harness.exitcodes import CannotJudge
    from harness.ci_speed.warmup import DEFAULT_ENGINE_CASE

    raised, _ = failed_lanes_beside_a_slow_prefetch
    assert isinstance(raised, CannotJudge), raised
    assert re.search(rf"warmup lane 1 \({DEFAULT_ENGINE_CASE}\): exit 125: .*no CUDA", str(raised)), str(raised)


def test_prefetch_is_planned_only_for_the_cases_that_need_it():
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.ci_speed.warmup import PREFETCH, plan_prefetch

    fp8 = [c for c in gpu_cases if gpu_cases[c].quant != "bf16"]
    assert fp8 and plan_prefetch(fp8) == ["flashinfer-fp8-blockscale-gemm-sm90"]
    assert plan_prefetch(["tiny-k1", "tiny-k3-share"]) == [] and plan_prefetch([]) == []
    assert plan_prefetch([], engine=True) == ["flashinfer-sampling"]
    assert plan_prefetch(["tiny-k2-yarn"]) == ["flashinfer-rope"]
    assert plan_prefetch(list(gpu_cases), engine=True) == list(PREFETCH)


def test_a_prefetch_runs_beside_the_lanes_and_never_fails_the_warmup(monkeypatch):
    """The real prefetch program runs (here, without an SM90 GPU, it builds nothing and says
    so); a prefetch that crashes is recorded with its exit code and last line, not raised:
    the lane that needs the kernel builds it itself."""
    from harness.ci_speed import warmup

    steps = warmup.run_lanes(None, [], prefetch=list(warmup.PREFETCH))
    assert [s["name"] for s in steps] == list(warmup.PREFETCH)
    if can_run.cannot_run_production_reason() is not None:
        assert all("error" not in s and "nothing built" in s["last_line"] for s in steps), steps
    monkeypatch.setitem(warmup.PREFETCH, "broken", (lambda cases, engine: True, "raise SystemExit('no such kernel')"))
    (st,) = warmup.run_lanes(None, [], prefetch=["broken"])
    assert st["error"] == "exit 1" and st["last_line"] == "no such kernel" and st["lane"] == "prefetch"


def test_a_failed_lane_stops_the_prefetches(failed_lanes_beside_a_slow_prefetch):
    from harness.exitcodes import CannotJudge
    from harness.ci_speed.warmup import DEFAULT_ENGINE_CASE

    raised, seconds = failed_lanes_beside_a_slow_prefetch
    assert isinstance(raised, CannotJudge), raised
    assert re.search(rf"warmup lane 1 \({DEFAULT_ENGINE_CASE}\): exit 125", str(raised)), str(raised)
    assert seconds < 60  # the 120 s prefetch killed, not waited for


@pytest.mark.parametrize("name", sorted(__import__("harness.ci_speed.warmup", fromlist=["PREFETCH"]).PREFETCH))
def test_each_prefetch_names_what_the_installed_vllm_and_flashinfer_hold(name, gc_paused):
    """Every ``from M import F`` of a prefetch program resolves in the installed packages (a
    rename upstream fails here, not as a silent prefetch error on a GPU host)."""
    import ast
    import importlib

    from harness.ci_speed.warmup import PREFETCH

    code = PREFETCH[name][1]
    imports = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.ImportFrom)]
    assert len(imports) >= 1
    for node in imports:
        with gc_paused():  # flashinfer's modules: a heavy import
            mod = importlib.import_module(node.module)
        for alias in node.names:
            assert callable(getattr(mod, alias.name)), f"{node.module}.{alias.name}"


def _stand_in_vllm(tmp_path, monkeypatch):
    """A package laid out as vllm/models/hy_v4 (what the model-info marker is keyed by)."""
    from harness.ci_speed import model_info_prefetch as model_info

    pkg = tmp_path / "src" / "stand_in_vllm"
    (pkg / "models" / "hy_v4" / "nvidia").mkdir(parents=True)
    for f in ("__init__.py", "models/__init__.py", "models/hy_v4/__init__.py", "models/hy_v4/nvidia/mtp.py"):
        (pkg / f).write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setattr(model_info, "PACKAGE", ("stand_in_vllm", "models", "hy_v4"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm-cache"))
    return pkg / "models" / "hy_v4"


def test_model_info_prefetch_is_wanted_only_where_vllm_is_built(monkeypatch):
    """Started for the commands that build a VllmConfig, on a host with a GPU, unless switched off."""
    from harness.ci_speed import model_info_prefetch as model_info
    from harness.cli import build_parser

    def wanted(*argv):
        return model_info.wanted(build_parser().parse_args(list(argv)))

    monkeypatch.delenv(model_info.OFF_ENV, raising=False)
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: ["/dev/nvidia0"])
    assert wanted("main") and wanted("--debug", "compare", "preset:tiny")
    assert wanted("bisect-check") and wanted("warmup", "--if-cold")
    assert wanted("warmup", "--lanes", "1")
    # with lanes the parent builds nothing: each lane (`harness warmup --case ...`) starts its own
    assert not wanted("warmup", "--lanes", "4") and not wanted("warmup", "--lanes=2")
    # a restore fills vLLM's layer of the cache root, where the inspection writes
    assert not wanted("warmup", "--restore", "pack") and not wanted("warmup", "--restore", "p", "--restore-only")
    assert not wanted("reference", "preset:tiny", "--out", "x")
    monkeypatch.setenv(model_info.OFF_ENV, "0")
    assert not wanted("main")
    monkeypatch.delenv(model_info.OFF_ENV)
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: [])
    assert not wanted("main")


def test_model_info_marker_is_keyed_by_the_model_files_and_cache_root(tmp_path, monkeypatch):
    """Once done for a tree and cache root it is not started again; an edited model file or
    another cache root starts it again; no such package, nothing to start."""
    from harness.ci_speed import model_info_prefetch as model_info

    hy = _stand_in_vllm(tmp_path, monkeypatch)
    key = model_info.tree_key()
    assert key and model_info.tree_key() == key and not model_info.done_for(key)
    (tmp_path / "vllm-cache").mkdir()
    (tmp_path / "vllm-cache" / model_info.MARKER).write_text(json.dumps({"key": key}))
    assert model_info.done_for(key) and model_info.start() is False and model_info._proc is None
    (hy / "nvidia" / "mtp.py").write_text("X = 22\n")
    assert model_info.tree_key() != key
    (hy / "nvidia" / "mtp.py").write_text("X = 1\n")
    os.utime(hy / "nvidia" / "mtp.py", ns=(1, 1))
    assert model_info.tree_key() != key  # same size, another mtime
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "elsewhere"))
    assert not model_info.done_for(model_info.tree_key())
    monkeypatch.setattr(model_info, "PACKAGE", ("no_such_pkg_hyv4", "models", "hy_v4"))
    assert model_info.tree_key() is None and model_info.start() is False


@pytest.mark.parametrize("child, wait_s, how", [
    ("import sys; sys.exit(5)", 30.0, "failed (exit 5)"),
    ("import time; time.sleep(60)", 0.5, "gave up after"),
])
def test_model_info_wait_never_blocks_a_run_on_a_failed_or_hung_prefetch(tmp_path, monkeypatch, capsys,
                                                                        child, wait_s, how):
    """A background inspection that fails or hangs: ``wait`` returns (killing a hung one and
    what it started), says so in one line, and writes no marker; vLLM then inspects itself."""
    from harness.ci_speed import model_info_prefetch as model_info
    from harness.production import run_hooks

    _stand_in_vllm(tmp_path, monkeypatch)
    monkeypatch.setattr(model_info, "_command", lambda key: [sys.executable, "-c", child])
    monkeypatch.setattr(model_info, "WAIT_S", wait_s)
    monkeypatch.setattr(model_info, "_proc", None)
    monkeypatch.setattr(run_hooks, "_hooks", {point: [] for point in run_hooks.POINTS})
    assert model_info.start() is True
    proc = model_info._proc
    assert model_info.start() is False  # one at a time
    run_hooks.fire("before_vllm_config")  # as build_vllm_config does: wait() joins it
    assert proc.poll() is not None and model_info._proc is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and how in err and "vLLM inspects as usual" in err
    assert not model_info.done_for(model_info.tree_key())
    model_info.wait()  # nothing running: nothing printed
    assert capsys.readouterr().err == ""


def test_an_engine_lane_beside_other_lanes_gets_a_fixed_kv_size_and_lanes_split_the_cores(tmp_path, monkeypatch):
    """vLLM's memory profiling fails when another lane frees GPU memory meanwhile: an engine lane
    that shares its wave gets ``HYV4_ENGINE_KV_CACHE_GIB`` (unless set); alone, it profiles. Lanes
    side by side get their share of the cores as torch threads (unless the user set a count)."""
    import time

    from harness.ci_speed import warmup
    from harness.production.can_run import THREAD_VARS
    from harness.production.engine.engine_env import ENGINE_KV_GIB_ENV, SHARED_GPU_KV_GIB

    monkeypatch.delenv(ENGINE_KV_GIB_ENV, raising=False)
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    seen = []

    class Lane:  # the lane process: writes an empty report, exits 0
        returncode = 0

        def __init__(self, cmd, stdout=None, stderr=None, env=None):
            env = env or {}
            seen.append(("--engine-only" in cmd, env.get(ENGINE_KV_GIB_ENV), env.get("OMP_NUM_THREADS")))
            with open(cmd[cmd.index("--report") + 1], "w") as f:
                json.dump({"steps": [{"name": "x", "seconds": 1.0}]}, f)

        def poll(self):
            return 0

    monkeypatch.setattr(warmup.subprocess, "Popen", Lane)

    def run_wave(wave):
        seen.clear()
        steps = []
        warmup._finish_wave(warmup._start_wave(wave, str(tmp_path), 0), steps, lambda *a, **k: None,
                            time.perf_counter())
        assert len(steps) == len(wave) and all(len(st["lane_span_s"]) == 2 for st in steps)
        return sorted(seen)

    engine = {"cases": [], "engines": [warmup.DEFAULT_ENGINE_CASE]}
    bf16 = {"cases": ["tiny-k3-share"], "engines": []}
    assert run_wave([engine, bf16]) == [(False, None, "8"), (True, SHARED_GPU_KV_GIB, "8")]
    assert run_wave([engine]) == [(True, None, None)]
    assert run_wave([engine, bf16, bf16]) == [(False, None, "5"), (False, None, "5"), (True, SHARED_GPU_KV_GIB, "5")]
    monkeypatch.setenv(ENGINE_KV_GIB_ENV, "6")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert (True, "6", "3") in run_wave([engine, bf16])


@pytest.mark.parametrize("stamped", [False, True])
def test_a_fresh_root_starts_the_lanes_before_the_checks_and_a_failed_check_stops_them(
        stamped, tmp_path, monkeypatch, no_jit_cache):
    """With lanes on a root where nothing is stamped, every wanted step is to be warmed whatever
    the versions: the prefetches and the lead start first and this process's own checks (vLLM's
    import) run meanwhile. A failed check is still the warmup's one line, exit 125, and stops
    every process started. With ``--if-cold`` on a stamped root the checks come first (the
    versions decide what is cold) and nothing starts when they fail."""
    import argparse
    import time

    from harness.ci_speed import warmup
    from harness.exitcodes import CannotJudge

    root = tmp_path / "root"
    if stamped:
        warmup.write_stamp(str(root), {"vllm": "other"}, {"tiny-k1": "f"})
    events, procs = [], []
    monkeypatch.setattr(can_run, "gpu_device_nodes", lambda: ["/dev/nvidia0"])  # a GPU host, as far as planning sees

    def reason():
        events.append("checks")
        return "stand-in: vLLM does not import"
    monkeypatch.setattr(can_run, "cannot_run_production_reason", reason)
    monkeypatch.setitem(warmup.PREFETCH, "slow", (lambda cases, engine: True, "import time; time.sleep(120)"))
    start_prefetch, start_wave = warmup._start_prefetch, warmup._start_wave

    def prefetch(names, tmp):
        events.append("prefetch")
        started = start_prefetch(names, tmp)
        procs.extend(p for _, p, _, _ in started)
        return started

    def wave(lanes, tmp, n):
        events.append("lead")
        running = start_wave(lanes, tmp, n)
        procs.extend(r[2] for r in running)
        return running
    monkeypatch.setattr(warmup, "_start_prefetch", prefetch)
    monkeypatch.setattr(warmup, "_start_wave", wave)
    args = argparse.Namespace(cache=str(root), case=["tiny-k1", "tiny-k3-share"], engine=warmup.DEFAULT_ENGINE_CASE,
                              no_engine=True, engine_only=False, lanes=2, if_cold=True, report=None, pack=None)
    t0 = time.perf_counter()
    with pytest.raises(CannotJudge, match="^warmup: stand-in: vLLM does not import$"):
        warmup.run(args, log=lambda *a, **k: None)
    assert time.perf_counter() - t0 < 60  # the 120 s prefetch was killed, not waited for
    assert events == (["checks"] if stamped else ["prefetch", "lead", "checks"])
    assert all(p.poll() is not None for p in procs)


def test_each_lane_and_prefetch_is_timed_to_its_own_end(monkeypatch):
    """The report's spans: a prefetch that ends while a lane still runs has its own end time
    (not the moment the lanes were done), and each lane's span covers its steps."""
    from harness.ci_speed import warmup

    def lane_command(cases, engine, report, mutants=False):  # a lane of 1.5 s that reports one step
        return [sys.executable, "-c", "import json, sys, time; time.sleep(1.5); "
                f"json.dump({{'steps': [{{'name': 'x', 'seconds': 1.5}}]}}, open({report!r}, 'w'))"]
    monkeypatch.setattr(warmup, "_lane_command", lane_command)
    monkeypatch.setitem(warmup.PREFETCH, "quick", (lambda cases, engine: True, "print('prefetch: built')"))
    steps = warmup.run_lanes(None, [{"cases": ["tiny-k3-share"], "engines": []}], prefetch=["quick"])
    (lane,) = [s for s in steps if s["lane"] == 1]
    (pre,) = [s for s in steps if s["lane"] == "prefetch"]
    assert lane["lane_span_s"][1] - lane["lane_span_s"][0] >= 1.5
    assert pre["span_s"][1] < lane["lane_span_s"][1] - 0.5, (pre, lane)
    assert pre["seconds"] < 1.0 and pre["last_line"] == "prefetch: built"


def test_a_reload_case_is_warmed_through_vllms_reload_and_a_refused_reload_is_not_a_cold_host(monkeypatch):
    """A reload case's production side is vLLM's in-place weight reload, which no plain load runs:
    warmup runs it through ``run_reload_case`` (bisect-check's own path for it), every other module
    case through the production half of the side by side. A reload vLLM refuses (``problems``) is a
    finding for bisect-check, not a host that cannot warm; any other failure still is."""
    import argparse

    from harness.ci_speed import warmup
    from harness.production.module import reload as module_reload, side_by_side

    specs = case_registry.specs(kind="module", without="probe")
    reload_id = next(c for c, s in specs.items() if s.reload_seed is not None)
    plain_id = next(c for c, s in specs.items() if s.reload_seed is None and not s.upstream_gaps)
    ran, refuse = [], []

    def reload_case(case, **kw):
        ran.append(("reload", case.id))
        if refuse:
            raise refuse[0]

    monkeypatch.setattr(module_reload, "run_reload_case", reload_case)
    monkeypatch.setattr(side_by_side, "run_production_side", lambda case, **kw: ran.append(("load", case.id)))
    monkeypatch.setattr(warmup, "write_stamp", lambda *a, **k: None)
    args = argparse.Namespace(engine=None, no_engine=True)
    todo = {reload_id: "f1", plain_id: "f2"}

    def warm():
        rep = {"steps": [], "versions": {}}
        warmup._in_this_process(rep, [reload_id, plain_id], todo, args, None, lambda *a, **k: None)
        return [s["name"] for s in rep["steps"]]

    assert warm() == [reload_id, plain_id] and ran == [("reload", reload_id), ("load", plain_id)]
    from harness.production.module.audit import LoadAuditError
    refuse.append(LoadAuditError(["reload: vLLM's reload_weights raised ValueError: x"]))
    assert warm() == [reload_id, plain_id]
    refuse[0] = RuntimeError("CUDA error: out of memory")
    with pytest.raises(warmup.CannotJudge, match=f"warmup {reload_id}: RuntimeError"):
        warm()


def test_an_engine_case_is_warmed_through_the_path_the_tier_runs_it(monkeypatch):
    """A reload engine case goes through the engine's reload path (``run_case`` refuses it), any
    other engine case through ``run_case``."""
    from harness.ci_speed import warmup
    from harness.production.engine import generation_judge, reload as engine_reload

    ran, refuse = [], []

    def reload_case(case, **kw):
        ran.append(("reload", case.id))
        if refuse:
            raise refuse[0]

    monkeypatch.setattr(generation_judge, "run_case", lambda case, **kw: ran.append(("run_case", case.id)))
    monkeypatch.setattr(engine_reload, "run_reload_engine_case", reload_case)
    engine_cases = case_registry.specs(kind="engine")
    reload_id = next(c for c, s in engine_cases.items() if s.graphs and s.reload_seed is not None)
    for cid in (warmup.DEFAULT_ENGINE_CASE, reload_id):
        warmup._warm_engine(engine_cases[cid])
    assert ran == [("run_case", warmup.DEFAULT_ENGINE_CASE), ("reload", reload_id)]
    # a reload vLLM refuses is the judged run's finding; any other failure still stops the warmup
    from harness.production.module.audit import LoadAuditError
    refuse.append(LoadAuditError(["reload: vLLM's reload_weights raised ValueError: x"]))
    warmup._warm_engine(engine_cases[reload_id])
    refuse[0] = RuntimeError("CUDA error: out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        warmup._warm_engine(engine_cases[reload_id])


def test_the_planted_bugs_are_warmed_in_a_lane_of_their_own_and_stamped(monkeypatch):
    """A planted bug can change what vLLM compiles (a routing constant baked into a torch.compile'd
    graph): warmup runs every planted bug's production side with the module cases (not with --case,
    --engine-only or --no-mutants), in a lane of its own with lanes, stamped by the registry's names."""
    import argparse

    from harness.ci_speed import warm_stamp, warmup
    from harness.mutants import driver

    ns = lambda **kw: argparse.Namespace(**{"case": None, "engine_only": False, "no_mutants": False,  # noqa: E731
                                            "mutants_only": False, **kw})
    assert warm_stamp.mutants_wanted(ns()) and warm_stamp.mutants_wanted(ns(mutants_only=True))
    assert not any(warm_stamp.mutants_wanted(a) for a in (ns(case=["tiny-k1"]), ns(engine_only=True),
                                                          ns(no_mutants=True)))
    fp = warm_stamp.mutants_fingerprint()
    assert len(fp) == 16 and fp == warm_stamp.mutants_fingerprint()
    cases = ["tiny-k1", "tiny-k3-share", "tiny-k2-fp8-split-long"]
    lead, lanes = warmup.plan_lanes(cases, [warmup.DEFAULT_ENGINE_CASE], 3, mutants=True)
    assert lanes[-1] == {"cases": [], "engines": [], "mutants": True} and len(lanes) == 3
    assert not any(lane.get("mutants") for lane in lanes[:-1])
    assert {c for lane in lanes for c in lane["cases"]} | {lead} == set(cases)
    assert warmup._lane_command([], [], "r.json", mutants=True)[-1] == "--mutants-only"
    assert warmup.engines_of(argparse.Namespace(engine=None, no_engine=False, mutants_only=True)) == []

    ran, stamped = [], []
    monkeypatch.setattr(driver, "warm_catalogue", lambda: ran.append(1) or {"ran": 2, "raised": []})
    monkeypatch.setattr(warmup, "write_stamp", lambda root, versions, warmed: stamped.append(warmed))
    rep = {"steps": [], "versions": {}}
    warmup._in_this_process(rep, [], {warmup.MUTANTS_STEP: fp}, argparse.Namespace(engine=None, no_engine=True),
                            "/nonexistent-root", lambda *a, **k: None)
    assert ran == [1] and [s["name"] for s in rep["steps"]] == [warmup.MUTANTS_STEP]
    assert stamped == [{warmup.MUTANTS_STEP: fp}] and rep["mutants"] == {"ran": 2, "raised": []}


def test_a_step_builds_the_launchers_of_the_triton_kernels_it_compiled_without_launching(monkeypatch):
    """vLLM's JIT warmup compiles Triton kernels with ``kernel.warmup()``, which builds no C
    launcher (Triton builds it at the first launch). A warmed step initialises each compiled,
    never-launched kernel of the process's JITFunctions as that launch would, leaves a launched one
    alone, and counts (does not raise) one Triton refuses to load; the step's record says so."""
    triton = pytest.importorskip("triton")
    import argparse
    import inspect

    from triton.compiler.compiler import CompiledKernel

    from harness.ci_speed import triton_launchers, warmup
    from harness.mutants import driver

    # the installed Triton's contract the warmup relies on: `_run` is None until the `run`
    # property's lazy initialisation builds the launcher
    assert "self._run = None" in inspect.getsource(CompiledKernel.__init__)
    assert "self._run = driver.active.launcher_cls(" in inspect.getsource(CompiledKernel._init_handles)
    assert isinstance(inspect.getattr_static(CompiledKernel, "run"), property)

    class Compiled:  # what the warmup touches of a CompiledKernel: `_run` and the `run` property
        def __init__(self, launched=False, refused=False):
            self._run, self.refused, self.inits = ("launcher" if launched else None), refused, 0

        @property
        def run(self):
            if self._run is None:
                self.inits += 1
                if self.refused:
                    raise RuntimeError("out of resources: shared memory, required: 300000, hardware limit: 232448")
                self._run = "launcher"
            return self._run

    @triton.jit
    def scale(x_ptr, n):
        pass

    pending, launched, refused = Compiled(), Compiled(launched=True), Compiled(refused=True)
    caches = {0: ({"a": pending, "b": launched, "c": refused}, {}, None, None, None)}
    monkeypatch.setattr(scale, "device_caches", caches, raising=False)
    monkeypatch.setattr(driver, "warm_catalogue", lambda: {"ran": 0, "raised": []})
    monkeypatch.setattr(warmup, "write_stamp", lambda root, versions, warmed: None)
    rep = {"steps": [], "versions": {}}
    warmup._in_this_process(rep, [], {warmup.MUTANTS_STEP: "fp"}, argparse.Namespace(engine=None, no_engine=True),
                            "/nonexistent-root", lambda *a, **k: None)
    assert rep["steps"][0]["launchers"] == {"kernels": 1, "refused": 1}  # no other kernel compiled on a CPU
    assert (pending.inits, pending._run, launched.inits, refused.inits) == (1, "launcher", 0, 1)
    assert triton_launchers.build_pending_launchers() == {"kernels": 0, "refused": 1}  # initialised once
    assert refused.inits == 2  # a refused one stays pending: Triton raises it again at a launch


def test_warming_the_planted_bugs_never_judges_and_never_raises(monkeypatch):
    """``warm_catalogue`` runs each planted bug's production side (no judge); one that raises is the
    tier's to report, so it is counted, not raised."""
    from harness.mutants import driver

    seen = []

    def run(case, m, judged=True):
        seen.append((m.name, judged))
        if len(seen) == 2:
            raise RuntimeError("the planted bug crashed production")
        return {}, []
    monkeypatch.setattr(driver, "_run", run)
    monkeypatch.setattr(driver, "_free", lambda: None)
    out = driver.warm_catalogue()
    names = [m.name for m in (*driver.CATALOGUE, *driver.GOLDEN_CATALOGUE)]
    assert [n for n, _ in seen] == names and not any(j for _, j in seen)
    assert out == {"ran": len(names), "raised": [names[1]]}


@pytest.mark.parametrize("same_versions", [True, False])
def test_a_root_stamped_warm_for_this_host_skips_the_host_checks(same_versions, tmp_path, monkeypatch,
                                                                  no_jit_cache):
    """``--if-cold`` on a root whose stamp holds every wanted step for this host's versions (read
    without importing vLLM): nothing to warm, and vLLM's import and the production checks are not
    paid (the runs that follow check the host themselves). Any other versions: the checks run
    and decide, as before."""
    import argparse

    from harness.ci_speed import warmup
    from harness.ci_speed.warm_stamp import fingerprint
    from harness.exitcodes import CannotJudge
    from harness.production.module import side_by_side

    here = {"torch": "2.11.0+cu130", "vllm": "0.33.0", "cuda": "13.0", "gpu": "NVIDIA H200", "capability": "9.0"}
    cases = ["tiny-k1", "tiny-k3-share"]
    specs = case_registry.specs(kind="module", without="probe")
    root = tmp_path / "root"
    warmup.write_stamp(str(root), here if same_versions else {**here, "vllm": "0.34.0"},
                       {c: fingerprint(specs[c]) for c in cases})
    asked, events = [], []
    monkeypatch.setattr(side_by_side, "versions", lambda **kw: asked.append(kw) or dict(here))

    def reason():
        events.append("checks")
        return "stand-in: the checks ran"
    monkeypatch.setattr(can_run, "cannot_run_production_reason", reason)
    args = argparse.Namespace(cache=str(root), case=cases, engine=warmup.DEFAULT_ENGINE_CASE, no_engine=True,
                              engine_only=False, lanes=2, if_cold=True, report=None, pack=None)
    if same_versions:
        rep = warmup.run(args, log=lambda *a, **k: None)
        assert events == [] and asked == [{"import_vllm": False}]
        assert rep["steps"] == [] and rep["skipped_warm"] == sorted(cases) and rep["versions"] == here
    else:
        with pytest.raises(CannotJudge, match="^warmup: stand-in: the checks ran$"):
            warmup.run(args, log=lambda *a, **k: None)
        assert events == ["checks"]
