"""Can the production path run here? One reason string, or None; and where the reference replays it.

Asked by every command and test that reaches vLLM on CUDA (``cannot_run_production_reason``,
``cannot_run_engine_reason``), and, without importing torch, by whatever decides on the GPU
device nodes alone (``gpu_device_nodes``: the pytest conftests, the CI-speed plugin).
"""

from __future__ import annotations


def cannot_run_production_reason() -> str | None:
    if not gpu_device_nodes():  # said without importing torch (~2 s); CUDA needs an NVIDIA device node
        return "no CUDA device"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (9, 0):
        return f"GPU capability {major}.{minor}: FlashMLA sparse and DeepGEMM need SM90+"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        return f"vLLM does not import: {exc.__class__.__name__}: {exc}"
    # the internals the production path reaches (one adapter for every release), then the
    # optional kernels a normal install of this vLLM would run
    from . import kernel_paths, vllm_compat
    from .engine import hook_points
    gone = vllm_compat.cannot_judge_reason()
    if gone:
        return gone
    drift = hook_points.problems(points=hook_points.MODULE_PATH_POINTS)
    if drift:
        return f"vLLM {vllm_compat.vllm_version()}: hook point {drift[0]}"
    return kernel_paths.cannot_judge_reason()


class BackgroundCheck:
    """``cannot_run_production_reason()``, asked once, in a background thread (``start``): what it
    imports (torch, CUDA, vLLM, the internals the production path reaches; measured as 13-15 s
    of every GPU-tier xdist worker's collection) then overlaps work that needs none of it, such as
    a test whose engine runs in a subprocess that checks the host itself. ``done``: whether the
    answer is in; ``reason``: the answer, waited for (what the check raised is raised there).
    Whoever then imports vLLM in this process waits for ``reason`` first: two threads importing
    vLLM's modules at once could meet its import cycles half-initialised."""

    def __init__(self):
        self._thread = None
        self._answer: tuple[str | None, BaseException | None] = (None, None)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        import threading

        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hyv4-host-check", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._answer = (cannot_run_production_reason(), None)  # looked up now: tests patch it
        except BaseException as exc:  # noqa: BLE001 - handed to whoever asks (reason)
            self._answer = (None, exc)

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self) -> None:
        """Until the check has ended, if it was started (a process ending before it asked)."""
        if self._thread is not None:
            self._thread.join()

    def reason(self) -> str | None:
        self.start()
        self.wait()
        reason, exc = self._answer
        if exc is not None:
            raise exc
        return reason


def cannot_run_engine_reason() -> str | None:
    """``cannot_run_production_reason``, then what the engine path and the speculator mutants
    need besides: the speculator internals and every hook point (``engine/hook_points.py``)."""
    reason = cannot_run_production_reason()
    if reason:
        return reason
    from . import vllm_compat
    from .engine import hook_points
    gone = vllm_compat.cannot_judge_reason(vllm_compat.REQUIRED)
    if gone:
        return gone
    drift = hook_points.problems()
    return f"vLLM {vllm_compat.vllm_version()}: hook point {drift[0]}" if drift else None


GPU_DEVICE_GLOB = "/dev/nvidia[0-9]*"


def gpu_device_nodes() -> list[str]:
    """The host's NVIDIA GPU device nodes (``/dev/nvidia0`` ...), without importing torch or
    initialising CUDA: what the pytest conftests decide on (workers, per-process tuning)."""
    import glob

    return sorted(glob.glob(GPU_DEVICE_GLOB))


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # torch's intra-op pool (OpenMP) and MKL's


def cpu_share(processes: int) -> int:
    """Intra-op CPU threads for each of ``processes`` processes computing at once on this host:
    its usable cores (the affinity mask, else the count) split evenly, at least 1. Each torch
    process otherwise starts one thread per core, and OpenMP threads that spin-wait against
    other processes' threads turn each small CPU op into milliseconds (measured: the judge's
    per-comparison time 60x its time alone, beside two engine processes)."""
    import os

    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, processes))


def shared_thread_env(env: dict, processes: int) -> dict:
    """``env`` for a child that computes beside ``processes - 1`` others: its thread variables
    set to this host's share (``cpu_share``) where the user set none."""
    out = dict(env)
    for var in THREAD_VARS:
        if not str(out.get(var, "")).strip():
            out[var] = str(cpu_share(processes))
    return out


def reference_device() -> str:
    """Where the float64 reference replays production: the GPU when one is present (the
    side by side's replay at real dims takes tens of seconds on a host CPU, well under a
    second on the GPU), unless ``HYV4_REFERENCE_DEVICE`` says otherwise (``cpu``/``cuda``)."""
    import os

    want = os.environ.get("HYV4_REFERENCE_DEVICE", "").strip().lower()
    if want in ("cpu", "cuda"):
        return want
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"
