"""The engine path: ``vllm.LLM`` with vLLM's own MTP speculator, every draft
forward recorded, then replayed by the float64 reference and the speculator's bookkeeping checked.

    engine_env.py          an engine subprocess's environment (torch-free; the cases are harness.case_registry's)
    process.py             engine subprocesses (``python -m harness engine``, one per case): start, collect,
                           stop; the CPU threads of the process beside them
    session.py             build the engine, reach the drafter, load and audit its weights
    taps.py                the eager taps: every draft forward and target forward recorded
    graph_tap.py           the graph-mode taps at the speculator's Python seams
    generation_judge.py    one generation recorded, replayed and judged; the mutant sweep; re-judge
    draft_replay.py        CPU: the reference over the recorded draft forwards, draft-token verdict
    recording.py           CPU: a recorded run saved for re-judging offline, and read back
    bookkeeping.py         CPU: accepted prefix, ``last_token_indices``, feeds, layer cycling
    acceptance.py          the edited dummy target whose drafts get accepted at planned rates
    speculator_mutants.py  planted bugs in vLLM's speculator (``--mutant NAME``)

May import: vLLM (lazily), ``reference``, ``harness``, ``harness.production.case_inputs``,
``harness.production.module`` (build, audit, capture, vllm_config) and
``harness.production.judging``; never ``harness.commands`` or ``harness.mutants``. ``draft_replay.py``,
``recording.py`` and ``bookkeeping.py`` never import vLLM.
"""
