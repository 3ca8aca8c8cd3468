"""The engine path: ``vllm.LLM`` with vLLM's own MTP speculator, every draft
forward recorded, then replayed by the float64 reference and the speculator's bookkeeping checked.

    cases.py               the engine cases (torch-free: case ids are checked before anything heavy)
    cli.py                 the command ``python -m harness.production.engine`` (``__main__.py``): its
                           arguments and "cannot judge" without torch, then ``run.run_checked``
    run.py                 build the engine, load and tap the drafter, run, judge
    replay.py              CPU: the reference over the recorded draft forwards, draft-token verdict
    bookkeeping.py         CPU: accepted prefix, ``last_token_indices``, feeds, layer cycling
    acceptance.py          the edited dummy target whose drafts get accepted at planned rates
    speculator_mutants.py  planted bugs in vLLM's speculator (``--mutant NAME``)

May import: vLLM (lazily), ``reference``, ``harness``, ``harness.production.cases``,
``harness.production.module`` (build, audit, capture, vllm_config) and
``harness.production.verdict``. ``replay.py`` and ``bookkeeping.py`` never import vLLM.
"""
