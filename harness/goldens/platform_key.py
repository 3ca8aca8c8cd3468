"""The platform a production golden or a host baseline belongs to, and the vLLM it was recorded with.

A golden holds vLLM's own numbers, which only the same hardware and toolchain reproduce to the
ulp: the key is the GPU model, its compute capability, torch and CUDA (``KEY_FIELDS``). The vLLM
version is not part of it: a bisect changes vLLM at every step (0.33.0, 0.33.1.devN+gHASH, ...),
and a golden is judged on every vLLM of its platform, failing when a release moves a number
until someone re-records it on purpose. The vLLM version and commit are stamped beside the key
(``recorded_with``) so a report can say what the golden was recorded with.
"""

from __future__ import annotations

KEY_FIELDS = ("gpu", "capability", "torch", "cuda")
# stamps written before the compute capability was part of the key lack it: not compared there
OPTIONAL_FIELDS = ("capability",)


def platform() -> dict:
    """This host's key: {gpu, capability, torch, cuda} of CUDA device 0 (needs torch and a GPU)."""
    import torch

    major, minor = torch.cuda.get_device_capability(0)
    return {"gpu": torch.cuda.get_device_name(0), "capability": f"{major}.{minor}",
            "torch": torch.__version__, "cuda": torch.version.cuda}


def recorded_with() -> dict:
    """{vllm, vllm_commit} of the installed vLLM (the commit: None where the build does not say)."""
    import vllm

    try:
        from vllm import _version
        commit = getattr(_version, "commit_id", None) or getattr(_version, "__commit_id__", None)
    except ImportError:
        commit = None
    return {"vllm": vllm.__version__, "vllm_commit": commit}


def key_of(stamp: dict) -> dict:
    """The key fields of a stored stamp (older stamps also hold the vLLM version: dropped)."""
    return {f: stamp.get(f) for f in KEY_FIELDS if f in stamp}


def mismatch(stored: dict, now: dict) -> tuple[str, object, object] | None:
    """(first key field that differs, stored value, this host's value), or None when ``stored``
    belongs to ``now``'s platform. A stored stamp without a field of ``OPTIONAL_FIELDS`` is not
    compared on it; one without any other key field does not match."""
    for field in KEY_FIELDS:
        if field not in stored and field in OPTIONAL_FIELDS:
            continue
        if stored.get(field) != now.get(field):
            return field, stored.get(field), now.get(field)
    return None


def describe(key: dict) -> str:
    """``gpu=<device name>, capability=9.0, torch=2.11.0+cu130, cuda=13.0`` (the fields present)."""
    return ", ".join(f"{f}={key[f]}" for f in KEY_FIELDS if f in key)


def describe_vllm(info: dict | None) -> str:
    """``vLLM 0.33.0 (g<commit>)``, or ``vLLM unknown`` for a stamp that does not say."""
    info = info or {}
    commit = info.get("vllm_commit")
    return f"vLLM {info.get('vllm') or 'unknown'}" + (f" ({commit})" if commit else "")
