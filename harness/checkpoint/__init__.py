"""HY V4 checkpoints: names, synthetic writer, exact loader, validation."""
