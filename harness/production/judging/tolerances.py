"""Per-component tolerances of vLLM's production path vs the float64 reference replayed on
production's own inputs (``replay.py``), judged as |prod - ref| <= atol + rtol*|ref|.

The numbers, with the rounding each absorbs and where they were measured, are the registry's
(``harness/components.py``: each component's ``tolerance`` per precision). Tables are keyed by
checkpoint quantization: ``tolerances_for(quant)`` / ``tolerance(component, quant)``; "bf16" is
``GPU_VS_REFERENCE`` (measured), "fp8" / "fp8-ue8m0" widen the components downstream of FP8 GEMMs
(CPU-estimated by ``fp8_emulation``, then checked on the GPU).

May import: ``harness.components``.
"""

from __future__ import annotations

from harness.components import TOLERANCES, tolerance_table

GPU_VS_REFERENCE = TOLERANCES["bf16"]
GPU_VS_REFERENCE_BY_QUANT = TOLERANCES
tolerances_for = tolerance_table


def tolerance(component: str, quant: str = "bf16"):
    """The tolerance of ``component`` (e.g. "attn.core") for a ``quant`` checkpoint."""
    return tolerances_for(quant)[component]
