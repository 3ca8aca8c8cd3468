"""The GPU commands, above every other layer: argument checking, printing and exit codes over
``harness.production`` (and ``harness.mutants``). Nothing below imports this package.

    compare.py   ``python -m harness compare`` / ``bisect-check`` (``harness.cli`` dispatches here)
    engine.py    ``python -m harness.production.engine``: the engine path's command (its arguments
                 checked before torch or vLLM is imported), its verdict lines and reports

May import: ``reference``, ``harness`` (any layer), ``harness.production``, ``harness.mutants``.
Entry-point shims (``harness/production/**/__main__.py``) import their command from here.
"""
