"""The GPU commands, above every other layer: argument checking, printing and exit codes over
``harness.production`` (and ``harness.mutants``). Nothing below imports this package.

    compare.py   ``python -m harness compare`` / ``bisect-check`` (``harness.cli`` dispatches here)
    engine.py    ``python -m harness.production.engine``: the engine path's command (its arguments
                 checked before torch or vLLM is imported), its verdict lines and reports
    history.py   ``python -m harness history`` (table, plots, drift, merge, ingest) and every
                 producer's ``--history`` (harness.history)
    autobisect.py  ``python -m harness autobisect`` and the step ``git bisect run`` runs
    nightly.py   ``python -m harness nightly``: the unattended nightly GPU job

May import: ``reference``, ``harness`` (any layer), ``harness.production``, ``harness.mutants``.
Entry-point shims (``harness/production/**/__main__.py``) import their command from here.
"""
