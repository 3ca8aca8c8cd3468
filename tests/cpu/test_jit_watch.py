"""What a judged run compiled under the JIT cache root (``harness.ci_speed.jit_cache.compiled_since``,
printed by ``harness.cli`` at the end of bisect-check, compare, mutants and the main job): a kernel
a warmup does not cover is named by its library and name; locks, logs, markers, bytecode and
vLLM's model inspection are no compilation."""

from __future__ import annotations

import argparse
import os

from harness.ci_speed import jit_cache


def _write(root, rel: str, data: bytes = b"x") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _warm_root(root) -> None:
    _write(root, "triton/AAAA/fused_moe_kernel.cubin")
    _write(root, "triton/AAAA/fused_moe_kernel.json")
    _write(root, "flashinfer/.cache/flashinfer/0.7.4/90a/cached_ops/fp8_blockscale_gemm_90/fp8_blockscale_gemm_90.so")
    _write(root, "deep_gemm/cache/sm90_fp8_gemm_1d2d.2001c0b3/kernel.cubin")
    _write(root, "deep_gemm/cache/sm90_fp8_gemm_1d2d.2001c0b3/.committed")


def test_new_kernels_are_named_by_library_and_the_rest_is_not_a_compilation(tmp_path):
    _warm_root(tmp_path)
    before = jit_cache.snapshot(str(tmp_path))
    assert len(before) == 5
    # not compilations: a lock, a log, a touched marker, bytecode, the package map, model inspection
    _write(tmp_path, "flashinfer/.cache/flashinfer/0.7.4/90a/cached_ops/tmp/sampling.lock")
    _write(tmp_path, "flashinfer/.cache/flashinfer/0.7.4/90a/flashinfer_jit.log")
    os.utime(tmp_path / "deep_gemm/cache/sm90_fp8_gemm_1d2d.2001c0b3/.committed", ns=(1, 10**18))
    _write(tmp_path, "pycache/x.cpython-312.pyc")
    _write(tmp_path, "python-metadata/packages.json")
    _write(tmp_path, "vllm/modelinfos/vllm-models-hy_v4-HYV4MTP.json")
    assert jit_cache.compiled_since(before, jit_cache.snapshot(str(tmp_path))) == {}
    assert "nothing compiled" in jit_cache.compiled_line(str(tmp_path), {})
    # compilations: a Triton kernel (its ~8 files, one name), a FlashInfer module, a DeepGEMM kernel,
    # a changed file of another layer
    for ext in ("cubin", "json", "llir", "ptx", "ttir"):
        _write(tmp_path, f"triton/BBBB/_shift_input_ids_kernel.{ext}")
    _write(tmp_path, "triton/CCCC/fused_moe_kernel.cubin")  # another variant of a warmed kernel
    _write(tmp_path, "flashinfer/.cache/flashinfer/0.7.4/90a/cached_ops/sampling/sampling.so")
    _write(tmp_path, "deep_gemm/cache/sm90_fp8_paged_mqa_logits.b823/kernel.cubin")
    _write(tmp_path, "cuda/ComputeCache/index", b"yy")
    # FlashInfer's TensorRT-LLM DeepGEMM (nvcc): named by its cache folder; its build's sources are none
    _write(tmp_path, "trtllm-deep-gemm/tmp/gemm_swapAB_896_256_128_16_128_1_81_8_1_Normal_17_42/kernel.cu")
    _write(tmp_path, "trtllm-deep-gemm/cache/gemm_swapAB_896_256_128_16_128_1_81_8_1_Normal/kernel.cubin")
    # Triton's C launcher of a kernel signature (gcc): a compilation, named by its cache folder
    _write(tmp_path, "triton/MEHIU4XHH3HFWHAZDPNPYQ4MVL33/__triton_launcher.cpython-312-x86_64-linux-gnu.so")
    built = jit_cache.compiled_since(before, jit_cache.snapshot(str(tmp_path)))
    assert built == {"cuda": ["index"], "deep_gemm": ["sm90_fp8_paged_mqa_logits"], "flashinfer": ["sampling"],
                     "triton": ["_shift_input_ids_kernel", "fused_moe_kernel", "launcher MEHIU4XHH3HF"],
                     "trtllm-deep-gemm": ["gemm_swapAB_896_256_128_16_128_1_81_8_1_Normal"]}
    line = jit_cache.compiled_line(str(tmp_path), built)
    assert line.startswith("JIT: compiled under ")
    assert "triton 3: _shift_input_ids_kernel, fused_moe_kernel, launcher" in line
    assert "\n" not in line
    # an entry written again (the driver's cache index updated, a module rebuilt over its old output)
    # is told apart from one the cache did not hold
    before = jit_cache.snapshot(str(tmp_path))
    _write(tmp_path, "cuda/ComputeCache/index", b"yyy")
    _write(tmp_path, "cuda/ComputeCache/4/b/4b04c29f97e227", b"sass")
    _write(tmp_path, "flashinfer/.cache/flashinfer/0.7.4/90a/cached_ops/sampling/sampling.so", b"rebuilt")
    _write(tmp_path, "triton/CCCC/fused_moe_kernel.json", b"{}")  # no cubin written: no Triton kernel built
    assert jit_cache.compiled_since(before, jit_cache.snapshot(str(tmp_path))) == {
        "cuda": ["4b04c29f97e227", "index (rewritten)"], "flashinfer": ["sampling (rewritten)"]}


def test_the_cli_watches_judged_commands_under_a_cache_root_only(tmp_path, monkeypatch, capsys):
    from harness import cli

    _warm_root(tmp_path)
    monkeypatch.setenv(jit_cache.JIT_CACHE_ENV, str(tmp_path))

    def cmd_compare(args):
        return 0
    watch = cli._jit_watch(argparse.Namespace(func=cmd_compare))
    _write(tmp_path, "triton/DDDD/_cache_inputs_kernel.cubin")
    watch()
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"JIT: compiled under {tmp_path} during this run (a warmup does not cover it): "
                   "triton 1: _cache_inputs_kernel"], out

    def cmd_synth(args):
        return 0
    assert cli._jit_watch(argparse.Namespace(func=cmd_synth)) is None  # compiles nothing: not watched
    monkeypatch.delenv(jit_cache.JIT_CACHE_ENV)
    assert cli._jit_watch(argparse.Namespace(func=cmd_compare)) is None  # no root: nothing to watch


def test_a_kernel_compiled_in_a_librarys_default_folder_is_named_as_outside_the_root(tmp_path, monkeypatch):
    """A library that writes to its own default folder although its variable points into the root
    (FlashInfer's TensorRT-LLM DeepGEMM in ~/.tensorrt_llm did, on every fresh host) compiled
    outside the root and every pack of it: the line says so, by layer and name, beside what the
    root got; a folder the user chose for a layer is theirs and not watched."""
    home, root = tmp_path / "home", tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var, sub in jit_cache.JIT_CACHE_LAYOUT.items():
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # the user's choice: not watched
    _warm_root(root)
    _write(home, ".tensorrt_llm/cache/gemm_swapAB_896_256_128/kernel.cubin")  # there before: not this run's
    before = jit_cache.snapshot(str(root))
    assert "~trtllm-deep-gemm/cache/gemm_swapAB_896_256_128/kernel.cubin" in before
    _write(home, ".tensorrt_llm/tmp/gemm_swapAB_1024_256_128_7/kernel.cu")
    _write(home, ".tensorrt_llm/cache/gemm_swapAB_1024_256_128/kernel.cubin")
    _write(home, ".cache/flashinfer/0.7.4/90a/cached_ops/sampling/sampling.so")
    _write(home, ".cache/torch/kernels/exp2_kernel_vectorized2_arch9.0_nvrtc13.0_sass")
    _write(home, ".triton/cache/EEEE/_other_kernel.cubin")  # the default of a layer the user moved
    _write(root, "triton/DDDD/_cache_inputs_kernel.cubin")
    built = jit_cache.compiled_since(before, jit_cache.snapshot(str(root)))
    assert built == {"triton": ["_cache_inputs_kernel"], "~flashinfer": ["sampling"],
                     "~torch-kernels": ["exp2_kernel_vectorized2_arch9.0_nvrtc13.0_sass"],
                     "~trtllm-deep-gemm": ["gemm_swapAB_1024_256_128"]}
    line = jit_cache.compiled_line(str(root), built)
    assert line.startswith(f"JIT: compiled under {root} during this run (a warmup does not cover it): triton 1:")
    assert ("compiled OUTSIDE it, in the library's default folder (no pack carries it): flashinfer 1: sampling; "
            "torch-kernels 1: exp2_kernel") in line and "trtllm-deep-gemm 1: gemm_swapAB_1024_256_128" in line
    only_outside = {k: v for k, v in built.items() if k.startswith("~")}
    line = jit_cache.compiled_line(str(root), only_outside)
    assert line.startswith(f"JIT: nothing compiled under {root} during this run; compiled OUTSIDE it")
    assert "(warm)" not in line and "\n" not in line
