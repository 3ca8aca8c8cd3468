"""Markdown table of `|d| prodnum` (production vs the production-numerics reference) per case
and component, max over draft steps, from the side by side's JSONL (tests/gpu/test_side_by_side.py
writes it under $HYV4_GPU_OUT). Optionally against an earlier run:

    python tools/prodnum_table.py AFTER.jsonl[.gz] [BEFORE.jsonl[.gz]]
"""
from __future__ import annotations

import gzip
import json
import sys

COLS = ["enorm", "hnorm", "attn.q_c", "attn.kv_c", "attn.k_pe", "attn.q", "attn.core", "attn.out",
        "final_norm", "logits"]


def load(path: str) -> dict[str, dict]:
    opener = gzip.open if path.endswith(".gz") else open
    out = {}
    with opener(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            per = {}
            for row in r["rows"]:
                comp = row["key"].split(".", 1)[1] if row["key"].startswith("step") else row["key"]
                v = row.get("max_abs_vs_prodnum")
                if v is not None:
                    per[comp] = max(per.get(comp, 0.0), float(v))
            cid = r["case"]["id"] if isinstance(r["case"], dict) else r["case"]
            out[cid] = {"quant": r["quant"], "passed": r["passed"], "per": per}
    return out


def fmt(v) -> str:
    return "-" if v is None else f"{v:.2g}"


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    after = load(argv[0])
    before = load(argv[1]) if len(argv) > 1 else {}
    cols = [c for c in COLS if any(c in a["per"] for a in after.values())]
    print("| case | quant | passed | " + " | ".join(c.replace("attn.", "") for c in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for case, a in after.items():
        b = before.get(case, {}).get("per", {})
        cells = []
        for c in cols:
            cell = fmt(a["per"].get(c))
            if c in b:
                cell = f"{fmt(b[c])} → {cell}"
            cells.append(cell)
        print(f"| {case} | {a['quant']} | {a['passed']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
