"""The GPU commands, above every other layer: argument checking, printing and exit codes over
``harness.production`` (and ``harness.mutants``). Nothing below imports this package.

    compare.py   ``python -m harness compare`` (and what bisect-check shares with it: one case run here)
    bisect_check.py  ``python -m harness bisect-check``: the bisect's cases, engines beside the side by
                 side, goldens or a host baseline, the 0 / 1 / 125 verdict
    record_baseline.py  ``bisect-check --record-baseline DIR``: this host's baseline at the good commit
    engine.py    ``python -m harness engine``: the engine path's command (its arguments
                 checked before torch or vLLM is imported), its verdict lines and reports
    history.py   ``python -m harness history`` (table, plots, drift, merge, ingest) and every
                 producer's ``--history`` (harness.history)
    autobisect.py  ``python -m harness autobisect`` and ``autobisect-step`` (the step ``git bisect run`` runs)
    nightly.py   ``python -m harness nightly``: the unattended nightly GPU job

May import: ``reference``, ``harness`` (any layer), ``harness.production``, ``harness.mutants``.
Every command is a subcommand of ``python -m harness`` (``harness.cli``); the one entry point is
``harness/__main__.py`` (and the console script ``hyv4-harness``): ``harness.entry.run``.
"""
