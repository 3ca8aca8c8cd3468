"""Which GPU test each xdist worker starts with: spread the long ones.

pytest-xdist's ``worksteal`` gives worker i the i-th contiguous slice of the collection at the
start, and an idle worker later steals the TAIL half of the longest queue. In collection order
(files alphabetically) the four engine tests, ~50 s each, were the head of one worker's
slice, where nothing steals them (measured: the warm tier took 194 s against 618 s of test
time over 6 workers, 103 s each if balanced). ``spread`` reorders the collection so that each
slice holds about the same expected seconds, longest first (the tail, what gets stolen, is
the short tests).

The expected seconds come from a measured run's JUnit (``durations.json`` beside the GPU
tests, written by ``python -m harness ci schedule``); a test it does not know counts as the median. A stale file
only makes the schedule worse, never a verdict different: the order of independent tests.
Every worker computes the same order (same items, same costs, same worker count), as xdist
requires.
"""

from __future__ import annotations

import statistics
import xml.etree.ElementTree as ET


def xdist_slices(n_items: int, n_workers: int) -> list[int]:
    """The slice sizes worksteal's first distribution gives (``len(pending) // nodes_remaining``)."""
    sizes, left = [], n_items
    for i in range(n_workers):
        size = left // (n_workers - i)
        sizes.append(size)
        left -= size
    return sizes


def spread(costs: list[float], n_workers: int) -> list[int]:
    """A permutation of ``range(len(costs))``: slices (``xdist_slices``) filled longest first,
    each test to the slice with the fewest expected seconds that has room (ties: the lower
    slice), each slice longest first. Deterministic."""
    sizes = xdist_slices(len(costs), max(1, n_workers))
    slices: list[list[int]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        k = min((k for k in range(len(sizes)) if len(slices[k]) < sizes[k]), key=lambda k: (load[k], k))
        slices[k].append(i)
        load[k] += costs[i]
    return [i for s in slices for i in s]


def load_durations(path: str) -> dict[str, float]:
    """{test node id: seconds} from ``path``; empty when absent or unreadable (then nothing moves)."""
    from ..exitcodes import CLIError
    from ..input_checks import read_json

    try:  # bounded, regular files only: a FIFO never blocks the run
        data = read_json(path, path)
        return {str(k): float(v) for k, v in data.get("seconds", {}).items()}
    except (OSError, ValueError, AttributeError, TypeError, OverflowError, RecursionError, CLIError):
        return {}


def expected_costs(nodeids: list[str], durations: dict[str, float]) -> list[float]:
    default = statistics.median(durations.values()) if durations else 1.0
    return [durations.get(n, default) for n in nodeids]


def junit_durations(junit_xml: str) -> dict[str, float]:
    """{node id: seconds} of a pytest JUnit file (classname ``tests.gpu.test_x`` -> ``tests/gpu/test_x.py``)."""
    out = {}
    for tc in ET.parse(junit_xml).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        parts = cls.split(".")
        mod = next((j for j in range(len(parts), 0, -1) if parts[j - 1].startswith("test_")), len(parts))
        nodeid = "/".join(parts[:mod]) + ".py::" + "::".join(parts[mod:] + [name])
        secs = float(tc.get("time", 0.0))
        if not 0 <= secs < float("inf"):
            raise ValueError(f"testcase {nodeid}: time {tc.get('time')!r} is not a finite number of seconds >= 0")
        out[nodeid] = round(secs, 1)
    return out


USAGE = "usage: python -m harness ci schedule JUNIT.xml DEST.json 'which run (host, commit)'"


def _main(argv: list[str]) -> int:
    from ..atomic import write_errors, write_failure
    from ..exitcodes import CLIError
    from ..input_checks import input_file, not_an_input, output_file

    if len(argv) != 3:
        raise CLIError(f"{USAGE} (got {len(argv)} argument(s))")
    junit, dest, source = argv
    input_file("JUNIT.xml", junit)
    output_file("DEST.json", dest)
    not_an_input("DEST.json", dest, junit)
    try:
        durations = junit_durations(junit)
    except (ET.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise CLIError(f"{junit}: not a pytest JUnit file ({exc.__class__.__name__}: {exc})") from exc
    except OSError as exc:
        raise CLIError(f"{junit}: cannot read it: {exc.strerror or exc}") from exc
    from ..atomic import atomic_write_json

    try:
        atomic_write_json(dest, {"source": source, "seconds": dict(sorted(durations.items()))}, indent=1)
    except write_errors() as exc:
        raise write_failure(dest, exc) from exc
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit codes are ``harness.exitcodes``'s: 0 written, 2 bad input (one line), 125 a full disk."""
    import sys

    from ..exitcodes import run_guarded

    argv = sys.argv[1:] if argv is None else list(argv)
    return run_guarded(_main, [a for a in argv if a != "--debug"], debug="--debug" in argv)

