"""Subprocess helper of test_production_fp8_prep: vLLM's config + FP8 weight loading on a CPU box.

    python tests/cpu/_vllm_config_probe.py config CASE_ID ...   # the runner's VllmConfig per case
    python tests/cpu/_vllm_config_probe.py load CASE_ID[@MUTANT] # + HYV4MTP built on CPU, load_weights
    python tests/cpu/_vllm_config_probe.py build CONFIGS.json   # HYV4MTP built per HF config dict: what it built
    python tests/cpu/_vllm_config_probe.py walk CASE_ID ...     # the module-level draft step as far as a CPU goes
    python tests/cpu/_vllm_config_probe.py plan PLAN.json       # {"config": [ids], "load": [ids], "build": [dicts],
                                                                #  "walk": [ids]}

``plan`` does all three in one process (vLLM imported once; tests/cpu/conftest.py
runs one plan per test run for every test module that asks): config first, under
the platform fake only (as ``config``), then ``load`` and ``build`` under the
runtime fakes too. Every line carries its "mode"; a config or load case that
raises prints {"mode", "id", "crash": traceback} and the next case still runs.

vLLM's config validation and model construction run only under a CUDA
platform; here one is faked (compiled extensions and ops stubbed, capability
9.0, device type cpu) in this throwaway process only. Nothing runs a kernel:
``load`` stops after ``HYV4MTP.load_weights`` (``process_weights_after_loading``
needs CUDA), i.e. it checks vLLM's name mapping, scale renaming and dtype
handling of the FP8 checkpoint, the loaded values, and each module's quant method against the
checkpoint's exclusion rules (``CASE_ID@MUTANT``: built under a planted bug's ``build_patch``). Prints JSON lines
starting with "{"; exit 77 when the faking itself fails (the test skips).
"""

from __future__ import annotations

import json
import os
import sys
import types


def _fake_cuda() -> None:
    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))

    class _Any(types.ModuleType):
        def __getattr__(self, n):
            if n.startswith("__"):
                raise AttributeError(n)
            return lambda *a, **k: None

    sys.modules["vllm.vllm_flash_attn"] = _Any("vllm.vllm_flash_attn")
    import torch
    import vllm.platforms as P
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class FakeH200(CudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id=0):
            return DeviceCapability(9, 0)

        @classmethod
        def has_device_capability(cls, capability, device_id=0):
            if isinstance(capability, tuple):
                capability = capability[0] * 10 + capability[1]
            return 90 >= capability

        @classmethod
        def get_device_name(cls, device_id=0):
            return "NVIDIA H200 (faked)"

        @classmethod
        def get_device_total_memory(cls, device_id=0):
            return 140 << 30

        @classmethod
        def is_fully_connected(cls, ids):
            return True

        @classmethod
        def device_count(cls):
            return 1

    P.current_platform = FakeH200()
    import vllm._custom_ops as ops
    for n in dir(ops):  # the capability queries (cutlass_scaled_mm_supports_*, cutlass_group_gemm_supported):
        if n.startswith("cutlass_") and "support" in n:  # an SM90 GPU has them
            setattr(ops, n, lambda *a, **k: True)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1


def _fake_cuda_runtime() -> None:
    """What building HYV4MTP touches beyond the config: ops namespaces, streams, device queries.

    vLLM's loader and layer modules are imported first: some register fake kernels for
    ``_C`` ops at import, which the stubbed namespaces below would refuse."""
    import importlib

    import torch
    import vllm.platforms as P
    for mod in ("vllm.model_executor.model_loader", "vllm.model_executor.layers.attention",
                "vllm.model_executor.layers.quantization.fp8"):
        importlib.import_module(mod)

    class _NS:
        def __init__(self, n):
            self._n = n

        def __getattr__(self, a):
            if a.startswith("__"):
                raise AttributeError(a)

            def op(*x, **k):
                raise RuntimeError(f"stub op {self._n}.{a} called")
            op.default = op
            return op

    for ns in ("_C", "_moe_C", "_flashmla_C", "_flashmla_extension_C", "_C_cache_ops", "_rocm_C",
               "_deepselect_C", "_flashkda_C", "_qutlass_C"):
        torch.ops.__dict__[ns] = _NS(ns)

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return None

    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Stream
    torch.accelerator.current_device_index = lambda: 0
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    type(P.current_platform).num_compute_units = classmethod(lambda cls, *a: 132)


def _config_lines(ids: list[str]) -> None:
    from harness import case_registry
    from harness.production.case_inputs import case_inputs
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.module.vllm_config import build_vllm_config

    for cid in ids:
        case = gpu_cases[cid]
        hf, _, _ = case_inputs(case)
        vc = build_vllm_config(hf, num_speculative_tokens=case.steps)
        d = vc.speculative_config.draft_model_config
        print(json.dumps({
            "mode": "config", "id": cid, "quantization": vc.model_config.quantization,
            "draft_quantization": d.quantization,
            "quant_config": type(vc.quant_config).__name__ if vc.quant_config is not None else None,
            "draft_model_type": d.hf_config.model_type,
            "draft_mtp_quant_algo": getattr(d.hf_config, "mtp_quant_algo", None),
            "draft_quantization_config": getattr(d.hf_config, "quantization_config", None),
            "dtype": str(d.dtype), "num_speculative_tokens": vc.speculative_config.num_speculative_tokens,
        }), flush=True)


def _dequant(w, s, block=(128, 128)):
    import torch

    from reference.fp8 import dequantize_block
    s = s.to(torch.float32).to(torch.float64) if s.dtype != torch.float64 else s
    return dequantize_block(w, s, block)


def _expected(weights: dict, n: int) -> dict:
    """vLLM parameter name (before process_weights_after_loading) -> expected float64 value
    (the entries of the layer's kind: MoE or dense MLP)."""
    import torch
    p = f"model.layers.{n}."
    b = p + "mtp_block."
    L = lambda k: weights[f"layers.0.{k}"]  # noqa: E731
    has = lambda k: f"layers.0.{k}" in weights  # noqa: E731
    out = {
        b + "self_attn.fused_qkv_a_proj.weight": torch.cat([L("attn.q_a_proj"), L("attn.kv_a_proj_with_mqa")]),
        b + "self_attn.q_b_proj.weight": L("attn.q_b_proj"),
        b + "self_attn.kv_b_proj.weight": L("attn.kv_b_proj"),
        b + "self_attn.o_proj.weight": L("attn.o_proj"),
        b + "self_attn.indexer.wq_b.weight": L("indexer.wq_b"),
        b + "self_attn.indexer.wk_weights_proj.weight": torch.cat([L("indexer.wk"), L("indexer.weights_proj")]),
        b + "self_attn.linear_gate.weight": L("attn.linear_gate"),
        b + "self_attn.learnable_sink_param": L("attn.sink"),
        b + "self_attn.indexer.k_norm.weight": L("indexer.k_norm.weight"),
        b + "self_attn.indexer.k_norm.bias": L("indexer.k_norm.bias"),
        p + "eh_proj.weight": L("eh_proj"),
        p + "enorm.weight": L("enorm"),
        p + "shared_head.head.weight": weights["lm_head"],
        "model.embed_tokens.weight": weights["embed_tokens"],
    }
    if has("mlp.experts.gate_proj"):
        out.update({
            b + "mlp.shared_experts.gate_up_proj.weight": torch.cat([L("mlp.shared_experts.gate_proj"),
                                                                     L("mlp.shared_experts.up_proj")]),
            b + "mlp.shared_experts.down_proj.weight": L("mlp.shared_experts.down_proj"),
            b + "mlp.experts.routed_experts.w13_weight": torch.cat([L("mlp.experts.gate_proj"),
                                                                    L("mlp.experts.up_proj")], dim=1),
            b + "mlp.experts.routed_experts.w2_weight": L("mlp.experts.down_proj"),
            b + "mlp.gate.weight": L("mlp.gate"),
            b + "mlp.expert_bias": L("mlp.expert_bias"),
        })
    else:
        out.update({b + "mlp.gate_up_proj.weight": torch.cat([L("mlp.gate_proj"), L("mlp.up_proj")]),
                    b + "mlp.down_proj.weight": L("mlp.down_proj")})
    return out


def _load_lines(cid: str) -> None:
    """``cid``: a GPU case id, or ``ID@MUTANT`` to build the model under that planted bug's
    ``build_patch`` (harness.mutants)."""
    import contextlib
    import logging

    import torch
    import vllm.platforms as P
    from vllm.config import set_current_vllm_config

    from harness.production.module import build
    from harness.production.module.checkpoint_cast import cast_for_vllm
    from harness import case_registry
    from harness.production.case_inputs import case_inputs
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.module.vllm_config import build_vllm_config

    case_id, _, mutant = cid.partition("@")
    case = gpu_cases[case_id]
    hf, ckpt, weights = case_inputs(case)
    vc = build_vllm_config(hf, num_speculative_tokens=case.steps)
    dev = torch.device("cpu")
    P.current_platform.device_type = "cpu"
    build.init_distributed(vc, dev)
    if mutant:
        from harness.mutants import BY_NAME
        patch = BY_NAME[mutant].build_patch()
    else:
        patch = contextlib.nullcontext()
    with patch:
        model = build.build_model(vc, dev)
    tap = build._WarningTap()
    lg = logging.getLogger("vllm.models.hy_v4.nvidia.mtp")
    lg.addHandler(tap)
    with set_current_vllm_config(vc):
        loaded = set(model.load_weights(iter(sorted(cast_for_vllm(ckpt).items()))))
    lg.removeHandler(tap)
    params = dict(model.named_parameters())
    n = hf["num_hidden_layers"]
    mismatches, dtypes = [], {}
    for name, want in _expected(weights, n).items():
        prm = params.get(name)
        if prm is None:
            mismatches.append(f"{name}: no such parameter")
            continue
        got = prm.detach()
        dtypes[name] = str(got.dtype).removeprefix("torch.")
        if got.dtype == torch.float8_e4m3fn:
            sname = next(name.removesuffix("weight") + s for s in ("weight_scale_inv", "weight_scale")
                         if name.removesuffix("weight") + s in params)
            scale = params[sname].detach()
            dtypes[sname] = str(scale.dtype).removeprefix("torch.")
            if scale.dim() == 4:  # ModelOpt FP8_PB_WO: [out_blocks, 1, in_blocks, 1]
                scale = scale.reshape(scale.shape[0], scale.shape[2])
            # compressed-tensors channel FP8: one scale per output row ([..., out, 1])
            channel = scale.shape[-1] == 1 and scale.shape[-2] == got.shape[-2] and got.shape[-2] > 1
            got = _dequant(got, scale, (1, got.shape[-1]) if channel else (128, 128))
        got = got.to(torch.float64)
        if got.shape != want.shape:
            mismatches.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        elif not torch.equal(got, want.to(torch.float64)):
            mismatches.append(f"{name}: max |d| {float((got - want).abs().max()):.3e}")
    from harness.production.module import audit
    from harness.production.module.side_by_side import fp8_kernel_notes
    notes = fp8_kernel_notes(model)
    methods = audit.module_quant_methods(model)
    print(json.dumps({"mode": "load", "id": cid, "n_params": len(params), "unloaded": sorted(set(params) - loaded),
                      "warnings": tap.messages, "mismatches": mismatches, "dtypes": dtypes,
                      "kernel_notes": notes, "quant_methods": methods,
                      "quant_problems": audit.quant_method_problems(hf, methods)}, default=str), flush=True)


# What a CPU walk may stop at: a compiled kernel this process stubbed out (``_fake_cuda_runtime``)
# or a CUDA-only torch call. Anything else (AttributeError, TypeError, ImportError ...) is the
# harness and the installed vLLM disagreeing on an API: "drift".
_KERNEL_STOPS = ("stub op ",  # a compiled op this process stubbed (_fake_cuda_runtime)
                 "Torch not compiled with CUDA", "Found no NVIDIA driver",  # torch's CUDA-only calls
                 "libcuda.so cannot found")  # Triton launching a kernel


def _unpinned_host_memory() -> None:
    """Pinned host buffers need a CUDA driver: metadata builders allocate them; here they are
    plain host memory (this throwaway process only)."""
    import functools

    import torch

    def unpinned(fn):
        @functools.wraps(fn)
        def call(*a, **k):
            k.pop("pin_memory", None)
            return fn(*a, **k)
        return call

    for name in ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like", "as_tensor"):
        if not getattr(getattr(torch, name), "_hyv4_unpinned", False):
            f = unpinned(getattr(torch, name))
            f._hyv4_unpinned = True
            setattr(torch, name, f)
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    torch.Tensor.is_pinned = lambda self, *a, **k: False


def _walk_lines(cid: str) -> None:
    """The module-level production path of ``cid`` step by step, as ``ProductionSession`` runs
    it, until the first kernel: vLLM's config, HYV4MTP built, ``load_weights``, the vLLM
    internals of ``harness.production.vllm_compat``, the engine path's hook points, every draft
    layer's KV binding and metadata builders, the step-0 metadata build (the V2 speculator's
    ``AttentionGroup.build_metadata``), then the draft forward. One JSON line: the steps
    reached, where it stopped, and whether the stop is a kernel or an API drift."""
    import traceback

    import torch
    import vllm.platforms as P
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    import reference as R
    from harness.production import vllm_compat
    from harness import case_registry
    from harness.production.case_inputs import case_inputs
    gpu_cases = case_registry.specs(kind="module", without="probe")
    from harness.production.engine import hook_points
    from harness.production.module import build, kv
    from harness.production.module.checkpoint_cast import cast_for_vllm
    from harness.production.module.vllm_config import build_vllm_config

    _unpinned_host_memory()
    reached, line = [], {"mode": "walk", "id": cid}
    try:
        case = gpu_cases[cid]
        hf, ckpt, _ = case_inputs(case)
        vc = build_vllm_config(hf, num_speculative_tokens=case.steps)
        reached.append("vllm_config")
        dev = torch.device("cpu")
        P.current_platform.device_type = "cpu"
        build.init_distributed(vc, dev)
        model = build.build_model(vc, dev)
        reached.append("build_model")
        with set_current_vllm_config(vc):
            model.load_weights(iter(sorted(cast_for_vllm(ckpt).items())))
        reached.append("load_weights")
        line["internals_missing"] = vllm_compat.missing()
        line["hook_point_problems"] = hook_points.problems(type(model))
        reached.append("internals+hook_points")
        cfg = R.MTPConfig.from_hf_dict(hf)
        first = R.make_case(cfg, case.seed, case.requests, case.tokens)
        req, pos = first.request.to(torch.long), first.positions.to(torch.long)
        num_req = int(req.max()) + 1
        bs = vc.cache_config.block_size
        layout = kv.BatchLayout(num_req, -(-(int(pos.max()) + case.steps + 1) // bs), bs, kv.block_table_width(vc))
        layers = kv.setup_draft_layers(vc, dev, layout.num_blocks)
        line["draft_layers"] = {d.name: type(d.group.get_metadata_builder()).__name__ for d in layers}
        reached.append("setup_draft_layers")
        seq_lens = [int(pos[req == r].max()) + 1 for r in range(num_req)]
        cam = kv.common_metadata(layout, req, pos, seq_lens, dev)
        reached.append("common_metadata")
        md, slots = kv.build_step_metadata(layers, cam, 0, vc)
        line["metadata"] = {k: type(v).__name__ for k, v in md.items()}
        reached.append("build_step_metadata")
        if case.hf_config().get("index_topk") is not None:
            model.set_topk_indices_buffer(torch.full((1024, int(hf["index_topk"])), -1, dtype=torch.int32))
        with set_current_vllm_config(vc), set_forward_context(md, vc, num_tokens=int(req.numel()), slot_mapping=slots):
            model(input_ids=first.input_ids.long(), positions=pos, hidden_states=first.hidden.to(torch.bfloat16))
        reached.append("forward")
    except Exception as exc:  # noqa: BLE001 - where the walk stopped is the answer
        text = f"{exc.__class__.__name__}: {exc}"
        line["stopped"] = text[:400]
        line["kernel_stop"] = isinstance(exc, (RuntimeError, AssertionError, NotImplementedError)) and any(
            k in text for k in _KERNEL_STOPS)
        line["traceback"] = traceback.format_exc()[-2500:]
    line["reached"] = reached
    print(json.dumps(line, default=str), flush=True)


def _build_lines(path: str) -> None:
    with open(path) as f:
        _build_configs(json.load(f))


def _build_configs(configs: list[dict]) -> None:
    """For each HF config dict: what vLLM's HYV4MTP constructor builds
    per MTP layer (attention kind, indexer, whether the sink reaches the attention impl, MLP kind,
    gate width, routed-expert SwiGLU clamp, RoPE class / rotary_dim / magnitude), or the error."""
    import torch
    import vllm.platforms as P

    from harness.production.module import build
    from harness.production.module.vllm_config import build_vllm_config

    for i, hf in enumerate(configs):
        try:
            vc = build_vllm_config(hf, num_speculative_tokens=max(1, int(hf.get("num_nextn_predict_layers", 1))))
            P.current_platform.device_type = "cpu"
            build.init_distributed(vc, torch.device("cpu"))
            model = build.build_model(vc, torch.device("cpu"))
        except Exception as exc:  # noqa: BLE001 (a refusal is an answer)
            print(json.dumps({"mode": "build", "i": i, "error": f"{type(exc).__name__}: {exc}"[:400]}), flush=True)
            continue
        layers = {}
        for idx, layer in model.model.layers.items():
            a, blk = layer.mtp_block.self_attn, layer.mtp_block
            impl = a.mla_attn.impl
            limit = None
            if blk.block_type == "moe":
                for mod in blk.mlp.experts.modules():
                    for holder in (mod, getattr(mod, "moe_config", None), getattr(mod, "quant_config", None),
                                   getattr(mod, "moe_quant_config", None)):
                        if holder is not None and getattr(holder, "swiglu_limit", None) is not None:
                            limit = float(holder.swiglu_limit)
            rot = a.rotary_emb
            layers[idx] = {
                "sparse": bool(a.is_sparse), "indexer": a.indexer is not None,
                "sink": getattr(impl, "sinks", None) is not None,
                "sink_param": hasattr(a, "learnable_sink_param"),
                "moe": blk.block_type == "moe",
                "shared": blk.block_type == "moe" and blk.mlp.shared_experts is not None,
                "gate": a.gate_projection_size_per_head if a.gated_mla else None,
                "swiglu_limit": limit,
                "rope": [type(rot).__name__, int(rot.rotary_dim), float(getattr(rot, "mscale", 1.0))],
            }
        print(json.dumps({"mode": "build", "i": i, "layers": layers}), flush=True)


_ENVIRON0 = dict(os.environ)


def _fresh_environ() -> None:
    """os.environ as the probe started, vLLM's env cache dropped: what one case does to the
    environment (vLLM sets VLLM_USE_DEEP_GEMM_E8M0=1 for a ue8m0 checkpoint) does not reach the next."""
    os.environ.clear()
    os.environ.update(_ENVIRON0)
    envs = sys.modules.get("vllm.envs")
    if envs is not None and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()


def _each(mode: str, ids: list[str], fn) -> None:
    """``fn(id)`` per id, each in the starting environment; a crash is that id's answer (a
    traceback line), the others still run."""
    import traceback

    for cid in ids:
        _fresh_environ()
        try:
            fn(cid)
        except Exception:  # noqa: BLE001
            print(json.dumps({"mode": mode, "id": cid, "crash": traceback.format_exc()[-4000:]}), flush=True)


def _keep_every_case_input() -> None:
    """A plan asks for most cases twice (``config``, then ``load`` / ``walk``): ``case_inputs``'s cache
    keeps 4 cases (a GPU host's real-dims weights are large), so the plan's 9 config cases had evicted
    each one before its load, and its synthetic checkpoint was written, read back and quantized again.
    This throwaway process's cases are tiny: keep them all. ``config`` reads only the HF dict (its
    JSON goes to a model directory), so each case's inputs reach ``load`` as built."""
    import functools

    from harness.production import case_inputs

    case_inputs._cached = functools.lru_cache(maxsize=None)(case_inputs._cached.__wrapped__)


def _plan(path: str) -> int:
    with open(path) as f:
        plan = json.load(f)
    try:
        _fake_cuda()
    except Exception as exc:  # noqa: BLE001
        print(f"cannot fake a CUDA platform: {exc!r}", file=sys.stderr)
        return 77
    # vLLM inspects each model class in a fresh subprocess (importing torch and vLLM again) when
    # its cache ($VLLM_CACHE_ROOT/modelinfos, here the probe's own directory) is empty: two of
    # them, ~46 s of CPU on CI's 2 cores. This throwaway process inspects in process instead.
    from harness.ci_speed.model_info_prefetch import inspect_in_this_process
    inspect_in_this_process()
    _keep_every_case_input()
    _each("config", plan.get("config", []), lambda cid: _config_lines([cid]))
    if plan.get("load") or plan.get("build") or plan.get("walk"):
        try:
            _fake_cuda_runtime()
        except Exception as exc:  # noqa: BLE001
            print(f"cannot fake a CUDA platform: {exc!r}", file=sys.stderr)
            return 77
        _each("load", plan.get("load", []), _load_lines)
        _each("walk", plan.get("walk", []), _walk_lines)
        _fresh_environ()
        _build_configs(plan.get("build", []))
    return 0


def main(argv: list[str]) -> int:
    mode, ids = argv[0], argv[1:]
    if mode == "plan":
        return _plan(ids[0])
    try:
        _fake_cuda()
        if mode in ("load", "build", "walk"):
            _fake_cuda_runtime()
    except Exception as exc:  # noqa: BLE001
        print(f"cannot fake a CUDA platform: {exc!r}", file=sys.stderr)
        return 77
    if mode == "config":
        _config_lines(ids)
    elif mode == "load":
        for cid in ids:
            _load_lines(cid)
    elif mode == "build":
        _build_lines(ids[0])
    elif mode == "walk":
        for cid in ids:
            _walk_lines(cid)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return 0


if __name__ == "__main__":
    # A throwaway process: the cyclic GC stays off. Importing vLLM grows the heap by millions of
    # objects, each growth step triggering a full collection that finds next to nothing (~4 s of
    # the probe's ~30 s of CPU); the peak RSS is the same without them (~1.5 GB), and so are the answers.
    import gc
    gc.disable()
    sys.exit(main(sys.argv[1:]))
