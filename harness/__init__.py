"""Everything that touches the outside world: presets, checkpoints, vLLM, goldens, CLI."""

from . import _issue44_old_names  # TEMPORARY (issue 44): delete with that module after the merge

_issue44_old_names.install()
