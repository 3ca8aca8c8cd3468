"""harness.ci_speed.xdist_schedule: the GPU tier's order under xdist worksteal (CPU; the installed xdist's real
scheduler)."""

from __future__ import annotations

import pathlib

import pytest
from hypothesis import given, strategies as st

from harness.ci_speed.xdist_schedule import expected_costs, junit_durations, load_durations, spread, xdist_slices

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _Node:
    """What WorkStealingScheduling calls on a worker: it records the indices it is sent."""

    def __init__(self, i):
        self.gateway = type("Gateway", (), {"id": f"gw{i}"})()
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


@pytest.mark.parametrize("n_items, n_workers", [(64, 6), (7, 3), (3, 6), (66, 6), (1, 1)])
def test_the_first_slices_are_the_installed_xdists(n_items, n_workers):
    """``xdist_slices`` is what pytest-xdist's own worksteal scheduler sends each worker first."""
    from xdist.scheduler.worksteal import WorkStealingScheduling

    sched = WorkStealingScheduling.__new__(WorkStealingScheduling)
    sched.numnodes, sched.node2collection, sched.node2pending = n_workers, {}, {}
    sched.pending, sched.collection, sched.config = [], None, None
    sched.steal_requested_from_node, sched.log = None, lambda *a: None
    nodes = [_Node(i) for i in range(n_workers)]
    names = [f"t{i}" for i in range(n_items)]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, names)
    sched.schedule()
    sizes = [len(node.sent) for node in nodes]
    assert sizes == xdist_slices(n_items, n_workers)
    assert [i for node in nodes for i in node.sent] == list(range(n_items))  # contiguous slices, in order


@given(st.lists(st.floats(0, 100), min_size=1, max_size=80), st.integers(1, 8))
def test_spread_is_a_permutation_that_balances_the_slices(costs, n):
    order = spread(costs, n)
    assert sorted(order) == list(range(len(costs))) and order == spread(costs, n)  # deterministic
    sizes = xdist_slices(len(costs), n)
    start, loads = 0, []
    for size in sizes:
        part = order[start:start + size]
        assert [costs[i] for i in part] == sorted((costs[i] for i in part), reverse=True)  # long first
        loads.append(sum(costs[i] for i in part))
        start += size
    if len(set(sizes)) == 1:  # equal room: greedy longest-first is within one test of balanced
        assert max(loads) - min(loads) <= max(costs) + 1e-9


def test_the_measured_tier_no_longer_starts_the_engine_tests_on_one_worker():
    """The measured tier (durations.json): in collection order the engine tests share worker 0's
    slice (measured in three runs: ~200 s of a 194 s wall; ~138 s against 67 s balanced; 95.0 s
    against 61.6 s where the engine tests took 19-25 s);
    spread over 6 workers no slice holds more than the longest test plus the balanced share, and
    the busiest slice is well below collection order's."""
    d = load_durations(str(ROOT / "tests/gpu/durations.json"))
    assert len(d) >= 60
    ids = sorted(d)  # the files in collection order (alphabetically); the engine tests first
    costs = expected_costs(ids, d)
    sizes = xdist_slices(len(ids), 6)

    def slice_loads(order):
        out, start = [], 0
        for size in sizes:
            out.append(sum(costs[i] for i in order[start:start + size]))
            start += size
        return out

    collection, balanced = max(slice_loads(list(range(len(ids))))), max(slice_loads(spread(costs, 6)))
    assert balanced <= sum(costs) / 6 + max(costs)
    assert collection > 1.3 * balanced  # the order is what xdist would run without harness.ci_speed.xdist_schedule


def test_durations_name_existing_gpu_tests_and_unknown_tests_cost_the_median(tmp_path):
    d = load_durations(str(ROOT / "tests/gpu/durations.json"))
    for nodeid in d:
        path, func = nodeid.split("::")[0], nodeid.split("::")[1].split("[")[0]
        assert f"def {func}(" in (ROOT / path).read_text(), nodeid
    assert expected_costs(["new::test"], {"a": 1.0, "b": 3.0, "c": 10.0}) == [3.0]
    assert load_durations(str(tmp_path / "missing.json")) == {}
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert load_durations(str(tmp_path / "bad.json")) == {}


def test_junit_node_ids(tmp_path):
    (tmp_path / "j.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_x" name="test_a[p-1]" time="1.26"/>'
        '<testcase classname="tests.gpu.test_x.TestK" name="test_b" time="2"/></testsuite></testsuites>')
    assert junit_durations(str(tmp_path / "j.xml")) == {"tests/gpu/test_x.py::test_a[p-1]": 1.3,
                                                        "tests/gpu/test_x.py::TestK::test_b": 2.0}


def test_the_speed_plugin_reorders_only_a_worksteal_worker_running_gpu_tests_alone():
    """The hook itself (``harness.ci_speed.pytest_plugin``), on stand-in items: a worksteal xdist
    worker whose items are all under tests/gpu gets ``spread``'s order; a controller, another
    --dist, or a run that holds a CPU test keeps the collection order."""
    import types

    from harness.ci_speed import pytest_plugin as mod
    d = load_durations(str(ROOT / "tests/gpu/durations.json"))
    ids = sorted(d)

    def items(paths_and_ids):
        return [types.SimpleNamespace(path=ROOT / nid.split("::")[0], nodeid=nid) for nid in paths_and_ids]

    def run(workerinput, dist, its):
        cfg = types.SimpleNamespace(option=types.SimpleNamespace(dist="no"))  # as xdist sets it on a worker
        if workerinput is not None:  # the controller's mode, as the plugin's pytest_configure_node sends it
            cfg.workerinput = {**workerinput, mod._DIST_KEY: dist}
        before = list(its)
        mod._spread_the_long_gpu_tests(cfg, its)
        return [before.index(i) for i in its]

    gpu = items(ids)
    assert run({"workercount": 6}, "worksteal", gpu) == spread(expected_costs(ids, d), 6) != list(range(len(ids)))
    assert run(None, "worksteal", items(ids)) == list(range(len(ids)))  # the controller collects nothing
    assert run({"workercount": 6}, "load", items(ids)) == list(range(len(ids)))
    mixed = items(ids + ["tests/cpu/test_schedule.py::test_junit_node_ids"])
    assert run({"workercount": 6}, "worksteal", mixed) == list(range(len(ids) + 1))


@pytest.mark.parametrize("junit", ["missing.xml", "bad.xml"])
def test_recording_from_bad_input_exits_2_in_one_line_and_writes_nothing(tmp_path, junit):
    import subprocess
    import sys

    (tmp_path / "bad.xml").write_text("<testsuites><testcase")
    dest = tmp_path / "durations.json"
    p = subprocess.run([sys.executable, "-m", "harness", "ci", "schedule", str(tmp_path / junit), str(dest), "a run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and junit in p.stderr
    assert not dest.exists()


def test_a_worker_learns_the_controllers_dist_mode_from_its_workerinput():
    """On a worker, xdist resets ``config.option.dist`` to "no" (the installed xdist's own
    ``setup_config``), so the reorder hook cannot read the mode there: the speed plugin's
    ``pytest_configure_node`` (run by the controller for each worker it starts) puts it in the
    worker's input. Without it a GPU run's timeline showed the tier in collection order."""
    import types

    from xdist.remote import setup_config

    from harness.ci_speed import pytest_plugin as mod

    cfg = types.SimpleNamespace(option=types.SimpleNamespace(dist="worksteal"), getvalue=lambda name: "worksteal")
    setup_config(cfg, None)
    assert cfg.option.dist == "no"
    for dist in ("worksteal", "load"):
        node = types.SimpleNamespace(config=types.SimpleNamespace(option=types.SimpleNamespace(dist=dist)),
                                     workerinput={"workerid": "gw0"})
        mod.pytest_configure_node(node)
        assert node.workerinput == {"workerid": "gw0", mod._DIST_KEY: dist}

