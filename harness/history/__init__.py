"""The run history: every verdict the harness reaches, kept in one SQLite file (stdlib ``sqlite3``).

    store.py    the file: schema (versioned, migrated), refusal of a file that is not ours, concurrent
                writers, ingest of a run's rows, merge of several files, queries
    ingest.py   a JSON report (``bisect-check`` / ``compare`` ``--report``, an engine report
                ``engine_mtp_<case>.json``, the GPU tier's ``gpu_side_by_side.jsonl``) -> one run's rows
    drift.py    the drift rule: errors that moved against their trailing median while still within
                tolerance, acceptance that fell
    plot.py     trend plots (PNG, matplotlib) per component and per acceptance figure
    bisect.py   ``git bisect run`` driven by the harness on a vLLM source tree (autobisect's control
                flow: start, run, culprit, restore the tree whatever happens)

One row per (run, case, component): the platform key (GPU, capability, torch, CUDA), the vLLM version
and commit, the harness commit, max |d|, mean |d|, the tolerance and the ratio to it, the verdict;
per (run, case, request) the acceptance as vLLM counts it, per draft position the share of drafts
accepted; per (run, case, phase) the seconds.

May import: ``harness.history``, ``harness.atomic``, ``harness.exitcodes``, ``harness.input_checks``,
``harness.env_vars``; no torch and no vLLM (the history is read and merged on any machine).
"""
