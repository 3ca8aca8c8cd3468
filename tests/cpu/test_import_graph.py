"""The project's import graph (``harness``, ``reference``): no import cycle at any level (an import
inside a function counts: a circle closed by a lazy import is still a circle), each layer imports
only what its package docstring allows (also inside functions), the CI-speed package and the
numeric harness stay apart, every module imports in a fresh interpreter, and no source file is
longer than ``MAX_LINES``."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("harness", "reference")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


# the calls that import a module named by a string when they run (harness.commands.passthrough's
# runners): counted as function-level imports, so the layer and circle rules see them
DEFERRED_IMPORTERS = ("import_module", "_deferred")


def _imports(name: str, path: Path, top_level_only: bool) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    nodes = []
    stack = list(tree.body)
    while stack:  # module level, including under if / try; functions and classes only when asked
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            nodes.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not top_level_only:
                stack.extend(node.body)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.stmt):
                    stack.append(child)
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for t in targets:
            while t and t not in MODULES:  # import a.b.c of a non-module attribute: its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    if not top_level_only:  # deferred imports by name: importlib.import_module("m") or _deferred("m", ...)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and getattr(node.func, "attr", getattr(node.func, "id", None)) in DEFERRED_IMPORTERS
                    and node.args[0].value in MODULES and node.args[0].value != name):
                found.add(node.args[0].value)
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(n: str):
        state[n] = 1
        path.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle_at_any_level():
    """Every module's imports, module level and inside functions (an ast walk of each file): a
    circle is broken by moving the shared piece down a layer, never by hiding an import."""
    graph = {n: _imports(n, p, top_level_only=False) for n, p in MODULES.items()}
    assert _cycle(graph) is None, f"import cycle (lazy imports included): {' -> '.join(_cycle(graph))}"


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The cycle test has teeth: a function-local import is an edge, so a circle it closes is found."""
    assert "harness.production.judging.trace_judge" in _imports(
        "harness.production.judging.fp8_emulation", MODULES["harness.production.judging.fp8_emulation"], False)
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    if True:\n        from harness import atomic\n")
    assert _imports("harness.lazy", lazy, top_level_only=False) == {"harness.atomic"}
    assert _imports("harness.lazy", lazy, top_level_only=True) == set()


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


# Layers, bottom up: what each may import (any level: a lazy import inside a function counts).
# A prefix allows the module and everything under it.
ALLOWED = {
    "reference": ("reference",),
    "harness.record_checks": (),  # the records' self-checks: under every registry
    "harness.components": ("harness.record_checks",),
    # the case registry and its specs: torch-free; the presets and the reference only when a case's
    # inputs are made; the closed sets of QUANTS and GRAPH_REGIMES (both torch-free)
    "harness.case_registry": ("harness.case_specs", "harness.record_checks", "harness.presets", "reference",
                              "harness.checkpoint.options", "harness.production.engine.graph_regimes"),
    "harness.case_specs": ("harness.record_checks", "harness.presets", "reference", "harness.checkpoint.options",
                           "harness.production.engine.graph_regimes"),
    "harness.production.case_inputs": ("reference", "harness.case_specs", "harness.record_checks", "harness.presets",
                                       "harness.checkpoint", "harness.production.engine.graph_regimes"),
    "harness.verdict": (),
    "harness.production.judging": ("reference", "harness.components", "harness.trace_compare", "harness.regimes",
                                   "harness.verdict",
                                   "harness.production.can_run", "harness.presets", "harness.checkpoint",
                                   "harness.production.case_inputs", "harness.case_registry", "harness.case_specs",
                                   "harness.record_checks",
                                   "harness.production.engine.graph_regimes", "harness.production.judging",
                                   # the emulation tools' one-line usage errors (exit 2), their paths checked
                                   # first and their JSON written all or nothing
                                   "harness.exitcodes", "harness.input_checks", "harness.atomic"),
    # the goldens' reference side runs on any machine: no harness.production, no vLLM
    "harness.goldens.store": ("harness.atomic", "harness.exitcodes", "harness.input_checks", "harness.trace_compare",
                              "harness.verdict"),
    "harness.goldens.reference": ("reference", "harness.goldens.store", "harness.case_registry", "harness.case_specs",
                                  "harness.record_checks", "harness.trace_compare", "harness.exitcodes",
                                  "harness.report"),
    "harness.production.module.capture": ("harness.components",),
    # harness.input_checks: the bounded reader of a recording (a FIFO or /dev/zero refused, no mmap)
    "harness.production.engine.draft_replay": ("reference", "harness.trace_compare", "harness.components",
                                               "harness.atomic", "harness.input_checks", "harness.production.judging",
                                               "harness.production.engine.bookkeeping"),
    "harness.production.engine.recording": ("harness.components", "harness.atomic", "harness.input_checks",
                                            "harness.production.engine.draft_replay",
                                            "harness.production.engine.bookkeeping"),
    "harness.production.engine.bookkeeping": ("harness.production.engine.spec_counts",),
    "harness.production.engine.spec_counts": (),  # what vLLM counts, read duck-typed: no vLLM, no torch
    # the run history: read, merged and plotted on any machine (no torch, no vLLM, no production)
    "harness.history": ("harness.history", "harness.atomic", "harness.exitcodes", "harness.input_checks",
                        "harness.env_vars"),
}
# The command layer, top of the stack: argument checking, printing, exit codes. Nothing below it
# imports it at any level; only the entry point (``harness.entry``, which ``harness/__main__.py``
# and the console script run, and nothing else imports) reaches up to run it.
COMMANDS = ("harness.cli", "harness.commands")
# Planted bugs: imported by the command layer only; they may import production, never the reverse.
MUTANTS = ("harness.mutants",)
# ... and by warmup, which runs each planted bug's production side unjudged: a bug can change what
# vLLM compiles, and the tier that plants it must find that compiled already
MUTANTS_USERS = ("harness.ci_speed.warmup",)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _under_any(name: str, prefixes) -> bool:
    return any(_under(name, p) for p in prefixes)


def _entry_point(name: str) -> bool:
    return name in ("harness.__main__", "harness.entry") or name.endswith(".__main__")


def _upward_imports() -> list[str]:
    """Every import, at any level, of a layer above the importing module."""
    problems = []
    for name, path in MODULES.items():
        imports = _imports(name, path, top_level_only=False)
        if not _under_any(name, COMMANDS) and not _entry_point(name):
            problems += [f"{name} imports {m}, the command layer above it" for m in sorted(imports)
                         if _under_any(m, COMMANDS)]
        if not _under_any(name, COMMANDS + MUTANTS + MUTANTS_USERS) and not _entry_point(name):
            problems += [f"{name} imports {m}: only the command layer may" for m in sorted(imports)
                         if _under_any(m, MUTANTS)]
    return problems


def test_layers_import_only_what_they_may():
    problems = []
    for name, path in MODULES.items():
        imports = _imports(name, path, top_level_only=False)
        layer = max((p for p in ALLOWED if _under(name, p)), key=len, default=None)
        if layer is not None:
            bad = [m for m in imports if not any(_under(m, ok) for ok in ALLOWED[layer])]
            problems += [f"{name} imports {m} (layer {layer})" for m in sorted(bad)]
        if name.startswith("reference"):
            assert not any(m.startswith("harness") for m in imports), name
    assert not problems, "\n".join(problems)


def test_nothing_imports_upward():
    problems = _upward_imports()
    assert not problems, "\n".join(problems)
    # the rule has teeth: the modules it must see are there, and it sees what they import
    assert "harness.commands.compare" in MODULES and "harness.commands.engine" in MODULES
    assert "harness.mutants" in _imports("harness.commands.compare", MODULES["harness.commands.compare"], False)
    assert "harness.commands.engine" in _imports("harness.commands.passthrough",
                                                 MODULES["harness.commands.passthrough"], False)


# The CI-speed machinery (``harness.ci_speed``) and the numeric harness (``reference``, ``harness``
# outside ci_speed) stay apart, at any level. The numeric harness reaches ci_speed only from the
# command entry points that apply the JIT cache root (and pause the GC, start the model-info
# prefetch) before vLLM is imported, each naming what it may import; the production path's own
# hook points (``harness.production.run_hooks``) carry the rest, registered from ci_speed.
CI_SPEED = "harness.ci_speed"
ENTRY_POINTS_INTO_CI_SPEED = {
    "harness.entry": ("harness.ci_speed.startup_gc", "harness.ci_speed.model_info_prefetch"),
    "harness.cli": ("harness.ci_speed.jit_cache", "harness.ci_speed.model_info_prefetch",
                    "harness.ci_speed.warmup"),  # warmup: the `harness warmup` command's arguments
    # the commands with their own parser: the JIT cache root before engine / goldens / side-by-side,
    # and `harness ci timeline|schedule|prefetch`
    "harness.commands.passthrough": ("harness.ci_speed.jit_cache", "harness.ci_speed.pytest_timeline",
                                     "harness.ci_speed.xdist_schedule", "harness.ci_speed.model_info_prefetch"),
}
# What ci_speed may import from the numeric harness: the shared plumbing of every command (atomic
# writes, the exit-code contract, input checks, the process clock and exit) anywhere; the rest only where a module must.
CI_SPEED_SHARED = ("harness.atomic", "harness.exitcodes", "harness.input_checks", "harness.process_clock",
                   "harness.process_exit")
CI_SPEED_MAY_IMPORT = {
    # it runs the production side of every GPU case to compile its kernels, asking first whether
    # production can run here; a reload case through its reload path (module or engine)
    "harness.ci_speed.warmup": ("harness.production.can_run", "harness.case_registry",
                                "harness.production.engine.engine_env", "harness.production.engine.generation_judge",
                                "harness.production.module.side_by_side", "harness.production.module.reload",
                                "harness.production.engine.reload",
                                "harness.mutants.driver"),  # the planted bugs' production runs (MUTANTS_USERS)
    # the planted bugs a warmup wants, by the component registry that names them (torch-free)
    "harness.ci_speed.warm_stamp": ("harness.components",),
    # the kernels warmup prefetches: which the GPU cases need; the device nodes, without torch
    "harness.ci_speed.kernel_prefetch": ("harness.production.can_run", "harness.case_registry"),
    # the GPU device nodes (is there a GPU to tune for, one per worker), without importing torch
    "harness.ci_speed.pytest_plugin": ("harness.production.can_run",),
    "harness.ci_speed.model_info_prefetch": ("harness.production.can_run",  # a GPU host only
                                             "harness.production.run_hooks"),  # joined before a VllmConfig
    "harness.ci_speed.startup_gc": ("harness.production.run_hooks",),  # resumed once vLLM is imported
}


def ci_speed_problems(graph: dict[str, set[str]]) -> list[str]:
    """Each import across the line between ci_speed and the numeric harness that the rule above
    does not name (``graph``: module -> the project modules it imports, at any level)."""
    problems = []
    for name, imports in sorted(graph.items()):
        if _under(name, CI_SPEED):
            allowed = CI_SPEED_SHARED + CI_SPEED_MAY_IMPORT.get(name, ())
            problems += [f"{name} (ci_speed) imports {m} from the numeric harness" for m in sorted(imports)
                         if not _under(m, CI_SPEED) and not any(_under(m, ok) for ok in allowed)]
        else:
            allowed = ENTRY_POINTS_INTO_CI_SPEED.get(name, ())
            problems += [f"{name} (numeric harness) imports {m}" + (
                "" if name in ENTRY_POINTS_INTO_CI_SPEED else ", and it is no entry point that applies the JIT cache")
                for m in sorted(imports) if _under(m, CI_SPEED) and m not in allowed]
    return problems


def test_ci_speed_and_the_numeric_harness_stay_apart():
    graph = {n: _imports(n, p, top_level_only=False) for n, p in MODULES.items()}
    assert CI_SPEED in graph and all(n in MODULES for n in ENTRY_POINTS_INTO_CI_SPEED), \
        "the rule names a module that does not exist"
    assert all(m in MODULES for ms in [*ENTRY_POINTS_INTO_CI_SPEED.values(), *CI_SPEED_MAY_IMPORT.values()]
               for m in ms), "the rule allows a module that does not exist"
    problems = ci_speed_problems(graph)
    assert not problems, "\n".join(problems)


def test_the_ci_speed_rule_fails_on_a_violation():
    assert ci_speed_problems({"harness.production.module.runner": {"harness.ci_speed.startup_gc"}})
    assert ci_speed_problems({"harness.cli": {"harness.ci_speed.pytest_plugin"}})
    assert ci_speed_problems({"reference.mtp": {"harness.ci_speed.jit_cache"}})
    assert ci_speed_problems({"harness.ci_speed.xdist_schedule": {"harness.production.case_inputs"}})
    assert not ci_speed_problems({"harness.cli": {"harness.ci_speed.jit_cache", "harness.production.can_run"},
                                  "harness.ci_speed.xdist_schedule": {"harness.atomic", "harness.ci_speed.jit_cache"}})


def test_every_module_imports_in_a_fresh_interpreter():
    names = [n for n in MODULES if not n.endswith("__main__")]
    code = ("import importlib, sys\nfailed = []\n"
            f"for n in {names!r}:\n"
            "    try:\n        importlib.import_module(n)\n"
            "    except Exception as e:\n        failed.append(f'{n}: {e!r}')\n"
            "print('\\n'.join(failed)); sys.exit(1 if failed else 0)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# No source file under harness/ or reference/ longer than this: a longer one holds more than one
# job (split it into steps or modules, each with its own name).
MAX_LINES = 600


def test_no_source_file_is_longer_than_max_lines():
    too_long = {}
    for path in MODULES.values():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            too_long[path.relative_to(ROOT).as_posix()] = n
    assert not too_long, f"longer than {MAX_LINES} lines: {too_long}"
