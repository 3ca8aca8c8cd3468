"""``ConfigError``: a config that the reference (or vLLM's kernels) cannot run.

Its own module, below both the config reader (``reference.config``) and the checks of a raw
``config.json`` (``reference.config_checks``), so the reader can run the checks and the checks can
raise it without either importing the other. Torch-free.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that the reference (or vLLM's kernels) cannot run."""
