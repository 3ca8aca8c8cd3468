"""One cache root for every JIT layer of the GPU stack (``$HYV4_JIT_CACHE``), Python's bytecode
and the installed-package map among them, applied before vLLM is imported; and the bytecode of the
big packages compiled all at once on a cold many-core host."""

from __future__ import annotations

JIT_CACHE_ENV = "HYV4_JIT_CACHE"

# Where each JIT layer of the GPU stack keeps what it compiled, relative to one cache root.
# Each variable is read by its library at import time, so they must be set before vLLM,
# FlashInfer, Triton, DeepGEMM or torch's inductor are imported.
JIT_CACHE_LAYOUT = {
    "VLLM_CACHE_ROOT": "vllm",                 # vLLM: torch.compile artefacts, its own kernel caches
    "TRITON_CACHE_DIR": "triton",              # Triton kernels (fused MoE, vLLM's Triton ops)
    "FLASHINFER_WORKSPACE_BASE": "flashinfer",  # FlashInfer JIT (FP8 block GEMM); it appends .cache/flashinfer
    "DG_JIT_CACHE_DIR": "deep_gemm",           # DeepGEMM JIT (indexer logits, FP8 GEMMs)
    "TORCHINDUCTOR_CACHE_DIR": "inductor",     # torch inductor
    "CUDA_CACHE_PATH": "cuda",                 # the driver's PTX -> SASS cache
    "HUMMING_CACHE_DIR": "humming",            # humming (imported by vLLM's FP8 linear kernels): its launcher
                                               # and nvrtc helper where its wheel's precompiled ones do not fit
    "TVM_FFI_CACHE_DIR": "tvm-ffi",            # tvm-ffi's JIT extensions (FlashInfer's and others' FFI)
    "TRTLLM_DG_CACHE_DIR": "trtllm-deep-gemm",  # FlashInfer's TensorRT-LLM DeepGEMM JIT (its FP8 block-scale
                                               # GEMMs, nvcc): its default is ~/.tensorrt_llm, outside the root
    "PYTORCH_KERNEL_CACHE_PATH": "torch-kernels",  # torch's jiterator (NVRTC) kernels; default ~/.cache/torch/kernels
    "CUTE_DSL_CACHE_DIR": "cute-dsl",          # CUTLASS DSL (CuTe) kernels (vLLM's router GEMMs); its default
                                               # is a folder under /tmp, outside the root and its packing
    "PYTHONPYCACHEPREFIX": "pycache",          # Python bytecode of torch / vLLM / FlashInfer (below)
    "HYV4_PACKAGE_MAP_CACHE": "python-metadata",  # importlib.metadata.packages_distributions() (below)
}
# Python bytecode is a JIT layer too: some GPU hosts set PYTHONDONTWRITEBYTECODE and ship
# torch without .pyc files, so every process re-compiled the sources of torch, transformers and
# vLLM, about three times slower than with a bytecode cache (benchmarks/NOTES.md). With a cache
# root, bytecode is written under ROOT/pycache (Python validates each .pyc against its source's
# mtime and size, so a changed source is recompiled, never served stale).
BYTECODE_VAR = "PYTHONPYCACHEPREFIX"
# humming (imported with vLLM's FP8 linear kernels) starts, at each import, two Python
# subprocesses that import torch only to find its launcher and nvrtc helper (about 5 CPU-s each):
# its wheel ships both precompiled, and a warm root holds what it built. Measured in a GPU tier:
# 70 such processes, 337 of its 2282 CPU-s. With this set, humming looks for them in the process
# that first uses them and builds there what is missing (the same artefacts, under its lock).
HUMMING_BG_BUILD_VAR = "HUMMING_DISABLE_PARALLEL_BUILD"


def jit_cache_env(root: str) -> dict[str, str]:
    """The environment that points every JIT layer at ``root``."""
    import os

    root = os.path.abspath(os.path.expanduser(root))
    return {var: os.path.join(root, sub) for var, sub in JIT_CACHE_LAYOUT.items()}


def apply_jit_cache(root: str | None = None) -> dict[str, str]:
    """Point the JIT layers at one cache root: ``root``, else ``$HYV4_JIT_CACHE``; without
    either, nothing changes (each library keeps its own default under ``~``). A variable the
    user already set wins. With a root, humming's background builds are off
    (``HUMMING_BG_BUILD_VAR``), Python bytecode is written under ROOT/pycache even where
    the host sets PYTHONDONTWRITEBYTECODE (unless PYTHONPYCACHEPREFIX is set already), and
    ``importlib.metadata.packages_distributions`` answers from ROOT/python-metadata
    (``memoize_packages_distributions``; an empty ``$HYV4_PACKAGE_MAP_CACHE`` turns that off).
    Returns the variables this call set. Cheap: imports no torch, vLLM or transformers."""
    import os

    root = root or os.environ.get(JIT_CACHE_ENV) or None
    if not root:
        return {}
    os.environ[JIT_CACHE_ENV] = os.path.abspath(os.path.expanduser(root))
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(4 << 30))  # the driver's default (256 MiB) evicts
    done = {}
    for var, path in jit_cache_env(root).items():
        if var not in os.environ:
            os.environ[var] = done[var] = path
    if BYTECODE_VAR in done:
        _write_bytecode_under(done[BYTECODE_VAR])
    if HUMMING_BG_BUILD_VAR not in os.environ:
        os.environ[HUMMING_BG_BUILD_VAR] = done[HUMMING_BG_BUILD_VAR] = "1"
    if os.environ.get(PACKAGE_MAP_VAR):
        memoize_packages_distributions(os.environ[PACKAGE_MAP_VAR])
    return done


def _write_bytecode_under(prefix: str) -> None:
    """This process and its children write and read bytecode under ``prefix``: Python reads
    both variables only at start-up, so this process is switched here (modules imported
    later use it) and the children through the environment."""
    import os
    import sys

    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


# transformers calls ``importlib.metadata.packages_distributions()`` when it is imported. That reads
# the RECORD of every installed distribution without a top_level.txt and stats each file listed
# there (seconds of import time: benchmarks/NOTES.md), in every process that imports vLLM. Its
# answer depends only on the installed distributions, so it is kept under the cache root, keyed
# by the Python, ``sys.path`` and each path entry's distribution directories with their mtimes
# (an install, upgrade or removal changes the key), and recomputed on any change.
PACKAGE_MAP_VAR = "HYV4_PACKAGE_MAP_CACHE"


def _distributions_key() -> str:
    """A digest of what ``packages_distributions()`` depends on: the Python, ``sys.path`` and,
    per path entry, its ``*.dist-info`` / ``*.egg-info`` entries and their mtimes (cheap: one
    directory listing per entry, no RECORD read)."""
    import hashlib
    import os
    import sys

    parts = [sys.version, repr(sys.path)]
    for entry in sys.path:
        try:
            with os.scandir(entry or ".") as it:
                found = sorted((e.name, e.stat().st_mtime_ns) for e in it
                               if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:  # not a directory (a zip, a missing entry): no distributions listed there
            continue
        parts.append(f"{entry}\0{found!r}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def memoize_packages_distributions(directory: str) -> None:
    """Make ``importlib.metadata.packages_distributions`` answer from ``directory`` when the
    installed distributions are the ones it was computed for (``_distributions_key``), else
    compute it as before and keep the answer there. The same dict either way (JSON keeps the
    order of keys and lists). A layer that cannot be read or written only costs the time."""
    import importlib.metadata as md
    import os

    if getattr(md.packages_distributions, "_hyv4_memo_of", None) is not None:
        return
    compute = md.packages_distributions

    def packages_distributions():
        path = os.path.join(directory, f"packages_distributions-{_distributions_key()}.json")
        from ..exitcodes import CLIError
        from ..input_checks import read_json

        try:  # bounded, regular files only: a FIFO never blocks the run
            doc = read_json(path, path)
            if isinstance(doc, dict) and all(isinstance(v, list) for v in doc.values()):
                return doc
        except (OSError, ValueError, RecursionError, CLIError):
            pass
        answer = compute()
        try:
            from ..atomic import atomic_write_json
            atomic_write_json(path, answer)
        except (OSError, TypeError, ValueError):
            pass
        return answer

    packages_distributions._hyv4_memo_of = compute
    packages_distributions.__doc__ = compute.__doc__
    md.packages_distributions = packages_distributions


# A cold bytecode layer (a fresh host) is filled by the first process, one module at a time as
# it imports (a cold `harness main` waits several times longer before vLLM's first log line).
# Where the host has the cores, ``precompile_bytecode`` compiles these packages'
# sources all at once instead (``compileall``, one process per core), before they are imported.
# Beyond torch, vLLM and transformers, `import vllm.models.hy_v4` (what vLLM's model-class
# inspection subprocesses import, several at once on a cold host) compiles sympy, scipy, pandas,
# networkx, openai, torchvision and numpy (the figures: benchmarks/NOTES.md).
PRECOMPILE_PACKAGES = ("torch", "vllm", "transformers",
                       "sympy", "scipy", "pandas", "networkx", "openai", "torchvision", "numpy")
PRECOMPILE_MIN_CPUS = 8  # below this, compiling every module costs more than compiling the imported
#                          ones as they come (CI's 2 cores: benchmarks/NOTES.md)
PRECOMPILED = "hyv4-precompiled.json"  # in the bytecode layer: {package dir: the Python that compiled it}


def precompile_bytecode(packages=None, min_cpus: int | None = None, prefix: str | None = None) -> list[str]:
    """Compile every source of ``packages`` into the bytecode layer (``prefix``, else
    ``sys.pycache_prefix`` as ``apply_jit_cache`` set it) on all cores, once per layer and
    Python: the package directories this call compiled, ``[]`` when there was nothing to do (no
    layer, fewer than ``min_cpus`` cores, or done before). Locates the packages without
    importing them. A source that does not compile is left to the import that needs it (which
    raises as it would have)."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    import time

    packages = PRECOMPILE_PACKAGES if packages is None else packages
    min_cpus = PRECOMPILE_MIN_CPUS if min_cpus is None else min_cpus
    prefix = prefix or sys.pycache_prefix
    if not prefix or (os.cpu_count() or 1) < min_cpus:
        return []
    marker = os.path.join(prefix, PRECOMPILED)
    try:
        with open(marker) as f:
            done = dict(json.load(f))
    except (OSError, ValueError, TypeError, RecursionError):
        done = {}
    todo = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        for d in map(str, (spec.submodule_search_locations or []) if spec else []):  # a Path on sys.path gives Paths
            if done.get(d) != sys.version and d not in todo:
                todo.append(d)
    if not todo:
        return []
    env = {**os.environ, BYTECODE_VAR: prefix}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    try:  # an optimisation only: where the layer cannot be written, imports compile as before
        os.makedirs(prefix, exist_ok=True)
        subprocess.run([sys.executable, "-m", "compileall", "-qq", "-j", "0", *todo], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        done.update({d: sys.version for d in todo})
        from ..atomic import atomic_write_json
        atomic_write_json(marker, done)
    except (OSError, TypeError, ValueError):
        return []
    print(f"bytecode: compiled {len(todo)} package dir(s) into {prefix} in {time.perf_counter() - t0:.1f} s "
          f"({os.cpu_count()} cores): {', '.join(todo)}", file=sys.stderr, flush=True)
    return todo


# ---- what a run compiled: the cache root before and after ----------------------------------------
# Not compilations: this host's bytecode and package map, lock files, logs, DeepGEMM's `.committed`
# markers (touched on every use) and vLLM's model-class inspection (`modelinfos`, model info JSON).
_NOT_COMPILED_LAYERS = ("pycache", "python-metadata")
_NOT_COMPILED_SUFFIXES = (".lock", ".log", ".committed", ".ninja_log", ".ninja_deps")


# Where each library compiles when its variable is not honoured (its own default folder), laid
# out as its layer in the root. A kernel written there during a run was compiled outside the root
# and its packs: FlashInfer's TensorRT-LLM DeepGEMM went on compiling into ~/.tensorrt_llm on every
# fresh host, with the JIT line saying nothing compiled, until it became a layer. Keys of these
# files in a ``snapshot`` start with OUTSIDE.
OUTSIDE = "~"
# layer -> (its library's default folder, where that folder sits inside the layer)
LIBRARY_DEFAULTS = {
    "triton": ("~/.triton/cache", ""),
    "flashinfer": ("~/.cache/flashinfer", ".cache/flashinfer"),  # its base defaults to the home folder
    "deep_gemm": ("~/.deep_gemm", ""),
    "trtllm-deep-gemm": ("~/.tensorrt_llm", ""),
    "torch-kernels": ("~/.cache/torch/kernels", ""),
    "cuda": ("~/.nv/ComputeCache", ""),
}


def _library_defaults(root: str) -> list[tuple[str, str]]:
    """[(default folder, its key prefix ``~LAYER[/inner]``)] for the layers whose variable points
    into ``root`` (a folder the user chose instead is theirs, not watched) and whose library
    default is outside it."""
    import os

    var_of = {sub: var for var, sub in JIT_CACHE_LAYOUT.items()}
    out = []
    for sub, (default, inner) in LIBRARY_DEFAULTS.items():
        var = var_of.get(sub)
        if var is None or not os.environ.get(var, "").startswith(root + os.sep):
            continue
        path = os.path.expanduser(default)
        if path.startswith("~") or (os.path.abspath(path) + os.sep).startswith(root + os.sep):
            continue  # no home folder to expand; or the default lies inside the root
        out.append((os.path.abspath(path), os.path.join(OUTSIDE + sub, inner) if inner else OUTSIDE + sub))
    return out


def snapshot(root: str) -> dict[str, tuple[int, int]]:
    """{path relative to ``root``: (size, mtime_ns)} of the compiled layers' files (cheap: one walk,
    ~2,400 files on a warmed SM90 host), and of the layers' library default folders outside the
    root (``LIBRARY_DEFAULTS``, keyed ``~LAYER/...``); {} when ``root`` is not a folder."""
    import os

    out = {}
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        return out
    folders = [(os.path.join(root, sub), sub) for sub in JIT_CACHE_LAYOUT.values() if sub not in _NOT_COMPILED_LAYERS]
    folders += _library_defaults(root)
    for top, key in folders:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                out[os.path.join(key, os.path.relpath(path, top))] = (st.st_size, st.st_mtime_ns)
    return out


def compiled_since(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, list[str]]:
    """{layer: sorted names of what was built} from two ``snapshot``s: a Triton kernel by its name, a
    FlashInfer or DeepGEMM module by its folder, any other layer by its new files' names. A name whose
    changed files all existed before is marked ``NAME (rewritten)``: the same entry written again (a
    module rebuilt over its old output, the driver's cache index updated) rather than a kernel the
    cache did not hold."""
    import os

    built: dict[str, set[str]] = {}
    new: dict[str, set[str]] = {}
    for rel, stat in after.items():
        if before.get(rel) == stat or rel.endswith(_NOT_COMPILED_SUFFIXES):
            continue
        parts = rel.split(os.sep)
        label = parts[0]  # the layer, or OUTSIDE + the layer for its library's default folder
        layer = label.removeprefix(OUTSIDE)
        parts[0] = layer  # the layer's own layout below, wherever its folder is
        if layer == "vllm" and ("modelinfos" in parts or parts[-1].endswith("model-info.json")):
            continue
        if layer == "triton":
            if parts[-1].startswith("__triton_launcher") and parts[-1].endswith(".so"):
                name = f"launcher {parts[-2][:12]}"  # Triton's C launcher of a kernel signature, built by gcc
            elif not parts[-1].endswith(".cubin"):
                continue  # one kernel writes ~8 files; its cubin names it
            else:
                name = parts[-1][:-len(".cubin")]
        elif layer == "flashinfer" and "cached_ops" in parts:
            name = parts[parts.index("cached_ops") + 1]
        elif layer == "deep_gemm" and "cache" in parts and len(parts) > parts.index("cache") + 1:
            name = parts[parts.index("cache") + 1].split(".")[0]
        elif layer == "trtllm-deep-gemm":  # cache/NAME/kernel.cubin; tmp/ holds a build's sources meanwhile
            if parts[1:2] != ["cache"] or len(parts) < 4:
                continue
            name = parts[2]
        else:
            name = parts[-1]
        built.setdefault(label, set()).add(name)
        if rel not in before:
            new.setdefault(label, set()).add(name)
    return {label: sorted(n if n in new.get(label, ()) else f"{n} (rewritten)" for n in names)
            for label, names in sorted(built.items())}


def compiled_line(root: str, built: dict[str, list[str]]) -> str:
    """One line: what this run compiled under ``root`` and in a layer's library default folder
    outside it (``~LAYER``: what no pack of the root carries), or that it compiled nothing."""
    def listed(items) -> str:
        return "; ".join(f"{layer} {len(names)}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
                         for layer, names in items)

    inside = [(k, v) for k, v in built.items() if not k.startswith(OUTSIDE)]
    outside = [(k.removeprefix(OUTSIDE), v) for k, v in built.items() if k.startswith(OUTSIDE)]
    text = (f"JIT: compiled under {root} during this run (a warmup does not cover it): {listed(inside)}" if inside
            else f"JIT: nothing compiled under {root} during this run" + ("" if outside else " (warm)"))
    if outside:
        text += ("; compiled OUTSIDE it, in the library's default folder (no pack carries it): "
                 + listed(outside))
    return text
