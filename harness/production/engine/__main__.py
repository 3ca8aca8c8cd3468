"""``python -m harness.production.engine``: the documented command path of the engine-path command
(``harness.commands.engine``, where the code lives)."""

from harness.ci_speed.jit_cache import apply_jit_cache
from harness.ci_speed.startup_gc import defer_gc

apply_jit_cache()  # $HYV4_JIT_CACHE, before vLLM is imported (as `python -m harness`)
defer_gc()  # until vLLM is imported (session.build_llm's vllm_imported point, before the engine is built)
from harness.commands.engine import main  # noqa: E402 - torch and vLLM only once the arguments are checked

if __name__ == "__main__":
    code = main()
    from harness.process_exit import exit_now
    exit_now(code)  # the report is written: skip the in-process engine's teardown (a hang costs the GPU slot)
