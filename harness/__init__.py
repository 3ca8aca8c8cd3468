"""Everything that touches the outside world: presets, checkpoints, vLLM, goldens, CLI."""
