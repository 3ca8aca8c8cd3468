"""Every ``HYV4_*`` environment variable the project reads, with what it means: the one place
they are documented. ``docs/cli.md`` is generated from ``ENV_VARS`` by ``tools/gen-cli-doc.py``,
and ``tests/cpu/test_cli_doc.py`` fails when a ``HYV4_`` name appears in the sources without an
entry here (or an entry here names a variable nothing reads).

Which values are accepted is checked elsewhere: ``harness.input_checks.ENVIRONMENT`` for the
variables ``python -m harness`` and pytest read (bad value: exit 2, one line), the shell scripts
for their own. An empty value means unset for every variable.

This module imports nothing (``harness.cli`` and the doc generator read it without torch).
"""

from __future__ import annotations

# name -> (who reads it, what it means). Grouped: first those harness.input_checks checks, then
# those only the shell scripts or test modules read.
ENV_VARS: dict[str, tuple[str, str]] = {
    "HYV4_JIT_CACHE": (
        "python -m harness, pytest, .ci/gpu-*, tools/offline-bundle/install.sh",
        "one cache root for every JIT layer (vLLM, Triton, FlashInfer, DeepGEMM, inductor, the driver's PTX "
        "cache, Python bytecode, ...) that later runs reuse; same as `warmup --cache DIR`. Unset: each "
        "library keeps its own default (install.sh restores a bundle's packed JIT cache into /tmp/jit-VERSION)"),
    "HYV4_PACKAGE_MAP_CACHE": (
        "python -m harness, pytest",
        "where the package map transformers asks `importlib.metadata` for on import is cached (default: "
        "`python-metadata` under `$HYV4_JIT_CACHE`); set but empty turns that cache off"),
    "HYV4_REPORT_DIR": (
        "python -m harness engine, GPU tests",
        "directory for the engine reports (`engine_mtp_<case>.json`) when `--out` is not given"),
    "HYV4_TIMELINE": (
        "pytest (set by .ci/gpu-tier)",
        "directory where every pytest process records its start-up, collection and each test's span; "
        "`python -m harness ci timeline DIR` prints where each worker's wall time went"),
    "HYV4_GOLDENS_ROOT": (
        "python -m harness, pytest",
        "another goldens tree instead of the checked-in `goldens/` (e.g. goldens recorded on this host); "
        "must exist"),
    "HYV4_ENGINE_KV_CACHE_GIB": (
        "engine runs (python -m harness, pytest)",
        "fixed KV cache size in GiB for `vllm.LLM`, so vLLM skips its memory profiling, which fails while "
        "other processes share the GPU (set automatically when they do)"),
    "HYV4_ENGINE_JIT_WARMUP": (
        "engine runs (python -m harness, pytest; .ci/gpu-tier sets 0 for its tests)",
        "`0`: build `vllm.LLM` with vLLM's start-up JIT warmup off (`kernel_config.enable_jit_warmup`), so "
        "each kernel is compiled on its first call instead of every key up front; the same kernels, not part "
        "of vLLM's compile hash. Unset or `1`: vLLM's default (on)"),
    "HYV4_SPECULATOR_MUTANT": (
        "engine runs (python -m harness, pytest)",
        "plant this bug of `harness.production.engine.speculator_mutants` in vLLM's speculator (a "
        "self-test: the verdict must fail)"),
    "HYV4_REFERENCE_DEVICE": (
        "python -m harness, pytest",
        "`cpu` or `cuda`: where the float64 reference replays production (default: the GPU when present)"),
    "HYV4_MODEL_INFO_PREFETCH": (
        "python -m harness",
        "`0`: do not start vLLM's model-class inspection in the background (main, compare, bisect-check, "
        "warmup)"),
    "HYV4_PYTEST_WORKERS": (
        "pytest",
        "xdist workers for the CPU tier: a number, `auto`, or `0` for serial (`-n N` / `-p no:xdist` win)"),
    "HYV4_WORKER_TEARDOWN": (
        "pytest",
        "`1`: an xdist worker on a GPU host ends through Python's interpreter teardown (default: it ends "
        "without it once its results are sent, which saves the controller seconds of waiting)"),
    "HYV4_ALLOW_MISSING_KERNELS": (
        "python -m harness, pytest",
        "`1`: judge even where an optional kernel path a normal install of this vLLM provides is missing "
        "(else exit 125); the output says `judged WITHOUT <path>` first and last"),
    "HYV4_REQUIRE_GOLDENS": (
        "pytest",
        "`1`: a golden test that cannot judge (no golden for this platform) fails instead of skipping; "
        "same as `--require-goldens`"),
    "HYV4_HISTORY": (
        "python -m harness (compare, bisect-check, history, autobisect, nightly), the engine command, pytest",
        "the run history (SQLite file, created if absent) each run is appended to; same as `--history PATH`. "
        "A file that is not a history (another database, damaged, a newer schema) is refused, exit 2"),
    # ---- read only by the shell scripts or by test modules ----
    "HYV4_JIT_PACK": (
        ".ci/gpu-tier",
        "a packed JIT cache (`warmup --pack DIR`) the tier's warmup restores into `$HYV4_JIT_CACHE` before "
        "anything compiles (`warmup --restore`); one of another key is refused in one line and not used"),
    "HYV4_REQUIREMENTS": (
        "with-env, .ci/run",
        "which pinned requirements file `./with-env` builds and runs in (default `requirements/ci.txt`; "
        "e.g. `requirements/vllm034.txt`, `requirements/hf.txt`), each in a venv of its own"),
    "HYV4_ENV_CACHE": (
        "with-env",
        "where `./with-env` keeps its virtual environments (default `~/.cache/hyv4-mtp-harness`)"),
    "HYV4_GPU_OUT": (
        "GPU tests, .ci/gpu-*",
        "directory where the GPU tests append their evidence (side-by-side results as JSON lines, "
        "traces); falls back to `$OUT`"),
    "HYV4_HF_ANY_VERSION": (
        "tests/hf",
        "`1`: run the HF transformers cross-check on a transformers older than the pinned one, if it "
        "ships `hy_v4`"),
    "HYV4_BUNDLE_STORE": (
        "tools/offline-bundle/install.sh",
        "where offline bundles are unpacked on the GPU host (default `/tmp/hyv4-bundle`)"),
    "HYV4_BASE_BUNDLE": (
        "tools/offline-bundle (bundle/install.sh)",
        "the unpacked base bundle a delta bundle installs over (default: the base's folder beside it)"),
    "HYV4_GOLDEN_DIR": (
        ".ci/gpu-release",
        "where `record` writes this host's goldens and `verdicts` judges them (default `/tmp/goldens-host`)"),
    "HYV4_BASELINE_DIR": (
        ".ci/gpu-release",
        "the host baseline `record` writes and `verdicts` judges against (default `/tmp/baseline-host`)"),
    "HYV4_CHECK_GOLDENS": (
        ".ci/gpu-release",
        "set: `record` also checks the goldens it recorded once more"),
}
