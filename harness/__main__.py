"""``python -m harness``: ``harness.entry.run`` (the console script ``hyv4-harness`` runs the same)."""

from .entry import run

run()
