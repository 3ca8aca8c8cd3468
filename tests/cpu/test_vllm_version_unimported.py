"""vLLM's version without importing vLLM (``vllm_compat.vllm_version_unimported``): what a warmup with
nothing to warm compares with its stamp. Exactly ``vllm.__version__`` where ``version.py`` takes it
from the generated ``_version.py``; None (the caller imports vLLM) wherever that is in doubt."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from harness.production.vllm_compat import vllm_version_unimported

VERSION_PY = ("try:\n    from ._version import __version__, __version_tuple__\n"
              "except Exception:\n    __version__ = 'dev'\n")


def _tree(tmp_path, version_py=VERSION_PY, generated="__version__ = version = '9.9.9rc1.dev3+gabc'\n"):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported')\n")
    (pkg / "version.py").write_text(version_py)
    if generated is not None:
        (pkg / "_version.py").write_text(generated)
    return tmp_path / "site"


@pytest.mark.parametrize("variant,expect", [
    ("wheel", "9.9.9rc1.dev3+gabc"),
    ("no _version.py", None),  # a source tree never built: vLLM says "dev", not this
    ("version.py elsewhere", None),  # a version.py that computes it some other way
    ("_version.py raises", None),
])
def test_the_generated_version_is_read_without_importing_vllm(variant, expect, tmp_path, monkeypatch):
    kw = {"no _version.py": {"generated": None},
          "version.py elsewhere": {"version_py": "__version__ = '1.0'\n"},
          "_version.py raises": {"generated": "raise ImportError('half written')\n"}}.get(variant, {})
    site = _tree(tmp_path, **kw)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.syspath_prepend(str(site))
    assert vllm_version_unimported() == expect
    assert "vllm" not in sys.modules


def test_the_installed_release_reads_as_its_wheel():
    try:
        wheel = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vLLM is not installed here")
    assert vllm_version_unimported() == wheel
