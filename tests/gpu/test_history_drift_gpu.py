"""GPU tier: the run history sees a change no verdict fails on.

Three runs of ``bisect-check`` on one side-by-side case without a golden (``tiny-k1``, judged
against the reference only, ``--allow-unjudged``) append to one history: two of vLLM as it is,
then one with the planted bug ``indexer-knorm-bf16`` (the indexer's k_norm built in bf16: below
the reference tolerance, the kind of change only a golden or a baseline sees). Every run exits 0;
``history --drift`` must name the moved component (exit 1), while the runs stay green. The
unplanted runs are deterministic on one GPU, so any move is the plant's; FACTOR 1.5 asks for a
move of half again, well above run-to-run noise (none) and below what one extra bf16 rounding
does to a max |d| that one rounding already sets.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

CASE, PLANT, FACTOR = "tiny-k1", "indexer-knorm-bf16", "1.5"


def test_a_change_below_every_tolerance_is_drift(tmp_path, capsys, monkeypatch):
    from harness.cli import main

    monkeypatch.delenv("HYV4_HISTORY", raising=False)
    hist = tmp_path / "history.sqlite"
    base = ["bisect-check", "--case", CASE, "--allow-unjudged", "--history", str(hist)]
    codes = [main(base), main(base), main([*base, "--plant", PLANT])]
    out = capsys.readouterr().out
    assert codes == [0, 0, 0], out[-4000:]
    code = main(["history", "--history", str(hist), "--drift", FACTOR, "--components", "--plots",
                 str(tmp_path / "plots")])
    out = capsys.readouterr().out
    print(out)
    assert code == 1, out[-4000:]
    lines = [x for x in out.splitlines() if x.startswith(f"drift: side-by-side/{CASE} ")]
    assert lines and any("indexer" in x for x in lines), out[-4000:]
    assert (tmp_path / "plots" / f"trend-side-by-side_{CASE}.png").is_file()
