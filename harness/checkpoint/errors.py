"""The one error type of the checkpoint code: it names the file, the tensor and the problem."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint the harness refuses: ``<file>: <tensor>: <problem>``.

    ``file`` is the path of the offending file (config.json, the index, a shard),
    ``tensor`` the checkpoint tensor name or None when the problem is not about
    one tensor, ``problem`` a sentence saying what is wrong and, where it helps,
    what vLLM 0.33 would do with it.
    """

    def __init__(self, file: str | os.PathLike | None, tensor: str | None, problem: str):
        self.file = None if file is None else str(file)
        self.tensor = tensor
        self.problem = problem
        parts = [p for p in (self.file, tensor) if p]
        super().__init__(": ".join([*parts, problem]))
