"""Project-wide pytest setup: markers, GPU gating, golden and checkpoint options, hypothesis
profiles. The suite's speed machinery (xdist workers, GC and malloc tuning, a worker's share of
the host, the JIT cache root, timelines) is the plugin ``harness.ci_speed.pytest_plugin``."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, settings

from harness.ci_env import ci_is_set
from harness.exitcodes import EXIT_CANNOT_JUDGE
from harness.production.can_run import BackgroundCheck, gpu_device_nodes

pytest_plugins = ["harness.ci_speed.pytest_plugin"]

# Hypothesis profiles, chosen the plugin's standard way: `--hypothesis-profile NAME` (the plugin's
# option) or `HYPOTHESIS_PROFILE=NAME` (the variable Hypothesis's settings guide reads); neither
# set: `ci`, or `gpu` when `-m` selects the GPU tests. No test pins max_examples: the profile
# decides how many examples every property test runs.
#   ci       Hypothesis's own `ci` profile (derandomized, no database, no deadline, too_slow
#            allowed, blobs printed) with 20 examples: the CPU tier, seeded and repeatable.
#   nightly  2000 examples, randomized, the example database kept: a deep run (no CI job selects it yet).
#   dev      50 examples: a quick local run.
#   gpu      `ci` with 3 examples: one example of a GPU property test is a vLLM run (TP=2).
settings.register_profile("ci", settings.get_profile("ci"), max_examples=20)
settings.register_profile(
    "nightly", max_examples=2000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True)
settings.register_profile("gpu", settings.get_profile("ci"), max_examples=3)
HYPOTHESIS_PROFILES = ("ci", "nightly", "dev", "gpu")


def pytest_addoption(parser):
    group = parser.getgroup("hyv4")
    group.addoption("--update-goldens", action="store_true",
                    help="rewrite goldens/ from this run (fails the run so the diff is reviewed; "
                         "refused when CI is set: true, 1, yes, ...)")
    group.addoption("--require-goldens", action="store_true",
                    help="a production golden missing for this platform fails its test (NOT JUDGED) instead of "
                         "skipping it; .ci/gpu-nightly sets it (env HYV4_REQUIRE_GOLDENS=1 works too)")
    group.addoption("--hyv4-checkpoint", metavar="PATH", default=None,
                    help="a real HY V4 checkpoint directory for the real_checkpoint tests")
    group.addoption("--history", metavar="PATH", default=None,
                    help="append this run's GPU verdicts (side-by-side lines, engine reports) to the run history "
                         "at PATH as one gpu-tier run (env HYV4_HISTORY works too; harness.history)")


def _check_environment(config) -> None:
    """The documented variables (``harness.input_checks.ENVIRONMENT``) and the Hypothesis profile
    (``--hypothesis-profile`` / ``$HYPOTHESIS_PROFILE``): a bad value is one ``ERROR:`` line (a
    usage error), not an INTERNALERROR traceback."""
    from harness.exitcodes import CLIError
    from harness.input_checks import environment

    try:
        # every one harness/env_vars.py documents and input_checks checks (the GPU tests read the engine's too)
        environment()
    except CLIError as exc:
        raise pytest.UsageError(str(exc)) from None
    for where, name in (("--hypothesis-profile", config.getoption("--hypothesis-profile", None)),
                        ("$HYPOTHESIS_PROFILE", os.environ.get("HYPOTHESIS_PROFILE", "").strip() or None)):
        if name is not None and name not in HYPOTHESIS_PROFILES:
            raise pytest.UsageError(f"{where}={name!r}: must be one of {', '.join(HYPOTHESIS_PROFILES)}")


def _hypothesis_profile(config) -> str:
    """The profile this run loads before the test modules are imported (their ``@settings`` take
    what they do not set from it). ``--hypothesis-profile`` is loaded again by Hypothesis's own
    plugin right after, so it wins over the variable."""
    name = config.getoption("--hypothesis-profile", None) or os.environ.get("HYPOTHESIS_PROFILE", "").strip()
    if name:
        return name
    markexpr = getattr(config.option, "markexpr", "") or ""
    return "gpu" if re.search(r"(?<!not )\b(multi)?gpu\b", markexpr) else "ci"


@pytest.hookimpl(tryfirst=True)  # before the speed plugin's: a bad variable is a usage error first
def pytest_configure(config):
    if config.getoption("--update-goldens") and ci_is_set():
        raise pytest.UsageError(f"--update-goldens is refused when CI is set (CI={os.environ.get('CI')!r}): "
                                "goldens are regenerated on purpose, by a person")
    _check_environment(config)
    settings.load_profile(_hypothesis_profile(config))
    _history_configure(config)


def _history_configure(config) -> None:
    """``--history`` / ``$HYV4_HISTORY`` in the controller (or a run without xdist): the file is
    checked now (a usage error when it is not a history), the GPU tests' report folders are set
    (a temporary one each when unset), and the variable is taken out of the environment so that
    the engine subprocesses the tests start do not record themselves a second time."""
    if hasattr(config, "workerinput"):
        return
    path = config.getoption("--history") or os.environ.get("HYV4_HISTORY", "").strip() or None
    os.environ.pop("HYV4_HISTORY", None)
    if not path:
        return
    from harness.exitcodes import CLIError
    from harness.history.store import check_history

    try:
        check_history(path)
    except CLIError as exc:
        raise pytest.UsageError(str(exc)) from None
    import tempfile
    import time

    from harness.history.ingest import now_utc

    for var in ("HYV4_GPU_OUT", "HYV4_REPORT_DIR"):
        if not os.environ.get(var, "").strip():
            os.environ[var] = tempfile.mkdtemp(prefix="hyv4-tier-")
    config._hyv4_history = (path, [os.environ["HYV4_GPU_OUT"], os.environ["HYV4_REPORT_DIR"]], now_utc(),
                            time.perf_counter())


def pytest_sessionfinish(session, exitstatus):
    state = getattr(session.config, "_hyv4_history", None)
    if state is None:
        return
    import time

    from harness.commands.history import record_tier

    path, dirs, started, t0 = state
    line = record_tier(path, dirs, int(exitstatus), started_at=started, seconds=round(time.perf_counter() - t0, 2))
    session.config._hyv4_history_line = line or f"history {path}: no GPU verdict written by this run: nothing recorded"


def pytest_terminal_summary(terminalreporter):
    line = getattr(terminalreporter.config, "_hyv4_history_line", None)
    if line:
        terminalreporter.write_line(line)


# Can production run here: asked once per pytest process, in the background from the end of its
# collection (harness.production.can_run.BackgroundCheck), and waited for by the first GPU test
# that runs production in this process. A ``gpu_subprocess`` test (its engine runs in a
# subprocess that checks the host itself) does not wait: it starts at once, and only its
# subprocess's "cannot judge" (125) asks for the answer (``production_gate``).
_HOST = BackgroundCheck()


def _reaches_production(item) -> bool:
    return bool(item.get_closest_marker("gpu") or item.get_closest_marker("multigpu")) \
        and not item.get_closest_marker("cuda_only")


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(config, items):
    gated = False
    for item in items:
        if item.get_closest_marker("cuda_only"):  # the reference on CUDA: vLLM not needed
            import torch
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        elif _reaches_production(item):
            if not gpu_device_nodes():  # what cannot_run_production_reason says first, without torch
                item.add_marker(pytest.mark.skip(reason="no CUDA device"))
            else:
                gated = True
        if item.get_closest_marker("real_checkpoint") and not config.getoption("--hyv4-checkpoint"):
            item.add_marker(pytest.mark.skip(reason="needs --hyv4-checkpoint PATH"))
    if gated:
        _HOST.start()


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures
def pytest_runtest_setup(item):
    if not _HOST.started or not _reaches_production(item) or item.get_closest_marker("skip"):
        return
    if item.get_closest_marker("gpu_subprocess") and not _HOST.done():
        return  # judged after its subprocess (production_gate)
    reason = _HOST.reason()
    if reason:
        pytest.skip(reason)
    if item.get_closest_marker("multigpu"):
        import torch
        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")


def pytest_unconfigure(config):
    _HOST.wait()  # a check still importing when the process ends (--collect-only) ends first


@pytest.fixture
def production_gate():
    """For a ``gpu_subprocess`` test: ``production_gate(returncode)`` after its subprocess. Exit 125
    on a host where this process's check says production cannot run is a skip, with that reason;
    any other result stands (a 125 on a host that can run production is the test's to judge)."""
    def gate(returncode: int) -> None:
        if returncode == EXIT_CANNOT_JUDGE and _HOST.started:
            reason = _HOST.reason()
            if reason:
                pytest.skip(reason)
    return gate


@pytest.fixture(scope="session")
def update_goldens(request) -> bool:
    return bool(request.config.getoption("--update-goldens"))


@pytest.fixture(scope="session")
def require_goldens(request) -> bool:
    return bool(request.config.getoption("--require-goldens")) or os.environ.get("HYV4_REQUIRE_GOLDENS") == "1"


@pytest.fixture(scope="session")
def hyv4_checkpoint(request) -> str | None:
    return request.config.getoption("--hyv4-checkpoint")
