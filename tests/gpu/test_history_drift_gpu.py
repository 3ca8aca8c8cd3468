"""GPU tier: the run history sees a change no verdict fails on.

A host baseline of one side-by-side case (``tiny-k1``) is recorded, then three runs of
``bisect-check --baseline`` append to one history: two of vLLM as it is (production against
its own recorded traces: max |d| exactly 0 where the GPU is deterministic), then one with the
planted bug ``indexer-knorm-bf16`` (the indexer's k_norm built in bf16). On ``tiny-k1`` every
context is shorter than ``index_topk``, so the indexer keeps every token whatever its keys:
the plant moves ``indexer.k`` by about one bf16 rounding, within its tolerance, and changes no
top-k set, token or downstream value. Every run exits 0; ``history --drift`` must name the
moved indexer component (exit 1), from the unplanted runs' values to the plant's. (Against the
reference alone the same plant moves ``indexer.k`` by about 15 %, inside the spread a drift
factor must tolerate: the baseline is what makes a change below every tolerance visible.)
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

CASE, PLANT, FACTOR = "tiny-k1", "indexer-knorm-bf16", "1.5"


def test_a_change_below_every_tolerance_is_drift(tmp_path, capsys, monkeypatch):
    from harness.cli import main

    monkeypatch.delenv("HYV4_HISTORY", raising=False)
    hist, base_dir = tmp_path / "history.sqlite", tmp_path / "baseline"
    assert main(["bisect-check", "--case", CASE, "--record-baseline", str(base_dir)]) == 0, \
        capsys.readouterr().out[-3000:]
    base = ["bisect-check", "--case", CASE, "--baseline", str(base_dir), "--history", str(hist)]
    codes = [main(base), main(base), main([*base, "--plant", PLANT])]
    out = capsys.readouterr().out
    assert codes == [0, 0, 0], out[-4000:]
    code = main(["history", "--history", str(hist), "--drift", FACTOR, "--components", "--plots",
                 str(tmp_path / "plots")])
    out = capsys.readouterr().out
    print(out)
    assert code == 1, out[-4000:]
    lines = [x for x in out.splitlines() if x.startswith("drift: ") and CASE in x]
    assert lines and any(".indexer." in x for x in lines), out[-4000:]
    assert list((tmp_path / "plots").glob("trend-*.png")), sorted(p.name for p in (tmp_path / "plots").iterdir())
