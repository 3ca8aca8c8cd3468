"""The exit-code contract of every command (``harness.exitcodes``), over a table of bad inputs.

0 good, 1 numeric mismatch or vLLM load failure, 2 bad input (checked first, on
any machine), 125 cannot judge. Every error is exactly one line naming the
culprit (file / tensor / key), never a traceback, and nothing is written or
clobbered: the ``--out`` / ``--report`` targets do not appear, the inputs keep
their bytes and mtimes.

The commands run in process (``harness.cli.main``). The production path is
replaced by a stub that fails the test if it is reached, and the machine is
made to look like a GPU host, so "exit 2 before any GPU question" is checked
even here on CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import case_registry
from harness.checkpoint.synth import synth_config, write_synthetic
from harness.cli import main as cli_main
from reference.config import MTPConfig
from reference.weights import random_weights

P = "model.mtp_layers.0."
INDEX = "model.safetensors.index.json"
S1, S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
FP8_SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """A tiny bf16 checkpoint in two shards and a tiny FP8 one (written once per module)."""
    root = tmp_path_factory.mktemp("contract-bases")
    hf = synth_config("tiny", vocab_size=128)
    w = random_weights(MTPConfig.from_hf_dict(hf), 5)
    return {"bf16": write_synthetic(root / "bf16", hf, w, shards=2),
            "fp8": write_synthetic(root / "fp8", hf, w, quant="fp8")}


class ProductionReached(AssertionError):
    pass


@pytest.fixture
def gpu_host(monkeypatch):
    """Looks like a GPU host; the production run itself must not be reached (stub raises)."""
    from harness.production import can_run
    from harness.production.module import side_by_side

    def must_not_run(case, **kw):
        raise ProductionReached(f"production reached for {case.id}: the input was not validated first")

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(side_by_side, "run_case", must_not_run)


def _snapshot(*paths) -> dict:
    """{file: (sha256, mtime_ns)} of every file under ``paths`` (missing paths: absent)."""
    snap = {}
    for p in map(Path, paths):
        files = [p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()) if p.exists() else []
        for f in files:
            snap[str(f)] = (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns)
    return snap


def _run(capsys, *argv, main=cli_main) -> tuple[int, list[str], str]:
    """(exit code, non-empty output lines, output) of ``main(argv)``; argparse's own exit counts too."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    text = out + err
    return code, [line for line in text.splitlines() if line.strip()], text


def _assert_one_line(code, lines, text, want_code, *culprits):
    assert code == want_code, text
    assert len(lines) == 1, text
    assert "Traceback" not in text, text
    for c in culprits:
        assert c in lines[0], f"{c!r} not named in: {lines[0]}"


# ---- checkpoint corruptions ------------------------------------------------------------------

def _config(fn):
    def mutate(d: Path):
        hf = json.loads((d / "config.json").read_text())
        hf = fn(hf)
        (d / "config.json").write_text(json.dumps(hf))
    return mutate


def _set(key, value):
    def fn(hf):
        hf[key] = value
        return hf
    return _config(fn)


def _tensor(name, fn, shard=None):
    """Rewrite ``name`` in its shard (``fn(t)`` -> new tensor, or None to drop it)."""
    def mutate(d: Path):
        wm = json.loads((d / INDEX).read_text())["weight_map"]
        f = d / (shard or wm[name])
        ts = load_file(str(f))
        new = fn(ts[name].clone())
        if new is None:
            ts.pop(name)
        else:
            ts[name] = new
        save_file(ts, str(f), metadata={"format": "pt"})
    return mutate


def _index(fn):
    def mutate(d: Path):
        doc = json.loads((d / INDEX).read_text())
        fn(doc)
        (d / INDEX).write_text(json.dumps(doc))
    return mutate


def _both(*mutations):
    def mutate(d):
        for m in mutations:
            m(d)
    return mutate


def _poke(idx, value):
    def fn(t):
        t.view(-1)[idx] = value
        return t
    return fn


def _copy_into_other_shard(name, change: bool):
    """``name`` also stored in the shard the index does not map it to (same or different content)."""
    def mutate(d: Path):
        wm = json.loads((d / INDEX).read_text())["weight_map"]
        here = wm[name]
        other = S2 if here == S1 else S1
        t = load_file(str(d / here))[name]
        ts = load_file(str(d / other))
        ts[name] = t + 1 if change else t
        save_file(ts, str(d / other), metadata={"format": "pt"})
    return mutate


def _add(name, shard):
    """A tensor ``name`` added to ``shard`` and to the index."""
    def mutate(d: Path):
        ts = load_file(str(d / shard))
        ts[name] = torch.zeros(4, dtype=torch.bfloat16)
        save_file(ts, str(d / shard), metadata={"format": "pt"})
        _index(lambda doc: doc["weight_map"].__setitem__(name, shard))(d)
    return mutate


def _truncate(shard, nbytes):
    def mutate(d: Path):
        f = d / shard
        os.truncate(f, f.stat().st_size - nbytes)
    return mutate


def _write(fname, data: bytes):
    def mutate(d: Path):
        (d / fname).write_bytes(data)
    return mutate


def _remove(fname):
    def mutate(d: Path):
        (d / fname).unlink()
    return mutate


NAN, INF = float("nan"), float("inf")
Q = P + "self_attn.q_b_proj.weight"
BIAS = P + "mlp.gate.e_score_correction_bias"
SCALE = P + "self_attn.indexer.wq_b.weight_scale_inv"
EXPERT_SCALE = P + "mlp.experts.3.up_proj.weight_scale_inv"

# (id, base, mutation, strings the one line must contain)
CHECKPOINT_CASES = [
    # config.json: types (vLLM's strict HYV4Config), values, shapes of the document
    ("hidden_size-float", "bf16", _set("hidden_size", 256.0), ["config.json", "hidden_size", "int"]),
    ("hidden_size-string", "bf16", _set("hidden_size", "256"), ["config.json", "hidden_size"]),
    ("hidden_size-bool", "bf16", _set("hidden_size", True), ["config.json", "hidden_size"]),
    ("heads-null", "bf16", _set("num_attention_heads", None), ["config.json", "num_attention_heads"]),
    ("heads-zero", "bf16", _set("num_attention_heads", 0), ["config.json", "num_attention_heads", ">= 1"]),
    ("quantization_config-list", "bf16", _set("quantization_config", ["fp8"]),
     ["config.json", "quantization_config"]),
    ("config-is-a-list", "bf16", _config(lambda hf: [hf]), ["config.json", "JSON object"]),
    ("config-not-json", "bf16", _write("config.json", b"{\"hidden_size\": 256,"), ["config.json"]),
    ("config-empty", "bf16", _write("config.json", b""), ["config.json"]),
    ("config-duplicate-key", "bf16", _write("config.json", b'{"hidden_size": 256, "hidden_size": 512}'),
     ["config.json", "hidden_size", "twice"]),
    ("index_topk-negative", "bf16", _set("index_topk", -1), ["config.json", "index_topk"]),
    ("index_topk-zero", "bf16", _set("index_topk", 0), ["config.json", "index_topk"]),
    ("eps-negative", "bf16", _set("rms_norm_eps", -1.0), ["config.json", "rms_norm_eps"]),
    ("eps-nan", "bf16", _set("rms_norm_eps", NAN), ["config.json", "rms_norm_eps", "finite"]),
    ("eps-int", "bf16", _set("rms_norm_eps", 1), ["config.json", "rms_norm_eps", "float"]),
    ("routed_scaling_factor-nan", "bf16", _set("routed_scaling_factor", NAN),
     ["config.json", "routed_scaling_factor"]),
    ("routed_scaling_factor-inf", "bf16", _set("routed_scaling_factor", INF),
     ["config.json", "routed_scaling_factor"]),
    ("swiglu_limit-nan", "bf16", _set("swiglu_limit", NAN), ["config.json", "swiglu_limit"]),
    ("gated_mla-string", "bf16", _set("gated_mla", "false"), ["config.json", "gated_mla"]),
    ("lm_head_fp32-string", "bf16", _set("enable_lm_head_fp32", "false"), ["config.json", "enable_lm_head_fp32"]),
    ("index_share-string", "bf16", _set("index_share_for_mtp_iteration", "false"),
     ["config.json", "index_share_for_mtp_iteration"]),
    ("torch_dtype-unknown", "bf16", _set("torch_dtype", "bfloat17"), ["config.json", "torch_dtype"]),
    ("torch_dtype-vs-dtype", "bf16", _set("dtype", "float16"), ["config.json", "dtype"]),
    ("mtp_layers-float", "bf16", _set("num_nextn_predict_layers", 1.0), ["config.json", "num_nextn_predict_layers"]),
    ("experts-alias-disagrees", "bf16", _set("num_local_experts", 16), ["config.json", "num_local_experts"]),
    ("layer_types-not-a-list", "bf16", _set("layer_types", "deepseek_sparse_attention"),
     ["config.json", "layer_types"]),
    ("rope_parameters-list", "bf16", _set("rope_parameters", [1]), ["config.json", "rope_parameters"]),
    ("gating_type-unknown", "bf16", _set("gating_type", "rowwise"), ["config.json", "gating_type"]),
    # the index and the shard files
    ("index-not-json", "bf16", _write(INDEX, b"{"), [INDEX]),
    ("index-without-weight_map", "bf16", _write(INDEX, b"{}"), [INDEX, "weight_map"]),
    ("index-maps-outside", "bf16", _index(lambda doc: doc["weight_map"].__setitem__(Q, "../x.safetensors")),
     [INDEX, Q]),
    ("index-maps-missing-file", "bf16", _index(lambda doc: doc["weight_map"].__setitem__(Q, "gone.safetensors")),
     [INDEX, Q, "gone.safetensors"]),
    ("shard-missing", "bf16", _remove(S2), [S2]),
    ("no-weights-at-all", "bf16", _both(_remove(S1), _remove(S2), _remove(INDEX)), ["model.safetensors"]),
    ("shard-truncated", "bf16", _truncate(S1, 4096), [S1, "truncated"]),
    ("shard-truncated-to-header", "bf16", _truncate(S2, 10 ** 6), [S2]),
    ("shard-corrupt-header", "bf16", _write(S1, b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage........"), [S1]),
    ("shard-empty", "bf16", _write(S2, b""), [S2]),
    ("tensor-missing", "bf16", _both(_tensor(Q, lambda t: None), _index(lambda doc: doc["weight_map"].pop(Q))),
     [Q, "missing"]),
    ("tensor-missing-from-shard", "bf16", _tensor(Q, lambda t: None), [Q]),
    ("lm_head-missing", "bf16", _both(_tensor("lm_head.weight", lambda t: None),
                                      _index(lambda doc: doc["weight_map"].pop("lm_head.weight"))),
     ["lm_head.weight", "missing"]),
    ("tensor-wrong-shape", "bf16", _tensor(Q, lambda t: t[:-1].clone()), [Q, "shape"]),
    ("tensor-wrong-dtype", "bf16", _tensor(Q, lambda t: t.to(torch.float16)), [Q, "dtype"]),
    ("tensor-extra-unknown", "bf16", _add(P + "self_attn.q_b_proj.bias", S2), [P + "self_attn.q_b_proj.bias"]),
    ("tensor-extra-mtp-layer", "bf16", _add("model.mtp_layers.1.enorm.weight", S1),
     ["model.mtp_layers.1.enorm.weight"]),
    ("weight-nan", "bf16", _tensor(Q, _poke(5, NAN)), [Q, "non-finite"]),
    ("weight-inf", "bf16", _tensor(Q, _poke(7, -INF)), [Q, "non-finite"]),
    ("expert-weight-nan", "bf16", _tensor(P + "mlp.experts.6.down_proj.weight", _poke(0, NAN)),
     [P + "mlp.experts.6.down_proj.weight", "non-finite"]),
    ("e_score_correction_bias-nan", "bf16", _tensor(BIAS, _poke(1, NAN)), [BIAS, "non-finite"]),
    ("sink-inf", "bf16", _tensor(P + "self_attn.learnable_sink_param", _poke(0, -INF)),
     [P + "self_attn.learnable_sink_param"]),
    ("duplicate-across-shards-same", "bf16", _copy_into_other_shard(Q, change=False), [Q, "duplicated", S1, S2]),
    ("duplicate-across-shards-different", "bf16", _copy_into_other_shard(BIAS, change=True),
     [BIAS, "duplicated", S1, S2]),
    ("mtp-tensor-outside-index", "bf16", _index(lambda doc: doc["weight_map"].pop(BIAS)), [BIAS, INDEX]),
    # FP8: scales and e4m3 payloads
    ("scale-nan", "fp8", _tensor(SCALE, _poke(0, NAN)), [SCALE, "non-finite"]),
    ("scale-inf", "fp8", _tensor(SCALE, _poke(0, INF)), [SCALE, "non-finite"]),
    ("scale-zero", "fp8", _tensor(SCALE, _poke(0, 0.0)), [SCALE, "zero"]),
    ("scale-negative", "fp8", _tensor(SCALE, _poke(0, -1.0)), [SCALE, "negative"]),
    ("expert-scale-nan", "fp8", _tensor(EXPERT_SCALE, _poke(0, NAN)), [EXPERT_SCALE, "non-finite"]),
    ("expert-scale-missing", "fp8", _both(_tensor(EXPERT_SCALE, lambda t: None),
                                          _index(lambda doc: doc["weight_map"].pop(EXPERT_SCALE))),
     [EXPERT_SCALE, "missing"]),
    ("scale-wrong-shape", "fp8", _tensor(SCALE, lambda t: t[:1].clone()), [SCALE, "shape"]),
    ("e4m3-nan", "fp8", _tensor(P + "self_attn.q_b_proj.weight",
                                lambda t: t.view(torch.uint8).index_fill_(0, torch.tensor([0]), 0x7F)
                                .view(torch.float8_e4m3fn)), [Q, "non-finite"]),
    ("fp8-stored-as-bf16", "fp8", _tensor(Q, lambda t: t.to(torch.bfloat16)), [Q, "FP8"]),
]


@pytest.fixture(scope="module")
def _made(tmp_path_factory):
    """Corrupted copies made so far (each made once, shared by the commands: they must not change it)."""
    return {"root": tmp_path_factory.mktemp("contract-bad")}


@pytest.fixture
def bad_dir(bases, _made, request):
    """(directory, culprits): a copy of a base checkpoint with one corruption applied."""
    cid, base, mutate, culprits = request.param
    if cid not in _made:
        d = _made["root"] / cid
        shutil.copytree(bases[base], d)
        mutate(d)
        _made[cid] = d
    return _made[cid], culprits


@pytest.mark.parametrize("bad_dir", CHECKPOINT_CASES, ids=[c[0] for c in CHECKPOINT_CASES], indirect=True)
@pytest.mark.parametrize("command", ["compare", "reference"])
def test_bad_checkpoint_is_bad_input(command, bad_dir, tmp_path, capsys, gpu_host):
    d, culprits = bad_dir
    target = tmp_path / "out" / ("r.json" if command == "compare" else "t.safetensors")
    before = _snapshot(d)
    flag = "--report" if command == "compare" else "--out"
    code, lines, text = _run(capsys, command, d, flag, target)
    _assert_one_line(code, lines, text, 2, *culprits)
    assert lines[0].startswith("error: "), text
    assert not (tmp_path / "out").exists()
    assert _snapshot(d) == before


def test_good_checkpoint_without_a_gpu_cannot_be_judged(bases, tmp_path, capsys, monkeypatch):
    from harness.production import can_run

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    for base in bases.values():
        before = _snapshot(base)
        code, lines, text = _run(capsys, "compare", base, "--report", tmp_path / "r.json")
        _assert_one_line(code, lines, text, 125, "cannot judge: no CUDA device")
        assert _snapshot(base) == before and not (tmp_path / "r.json").exists()


# ---- production outcomes: vLLM load failures are bad commits, other crashes cannot judge -------

def _production_raises(monkeypatch, exc):
    from harness.production import can_run
    from harness.production.module import side_by_side

    from harness.production.engine import process as engine_process

    def run_case(case, **kw):
        raise exc

    def start_engine_cases(case_ids, **kw):  # the engine cases (subprocesses) fail the same way, first
        if case_ids:
            raise exc
        return []

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(side_by_side, "run_case", run_case)
    monkeypatch.setattr(engine_process, "start_engine_cases", start_engine_cases)


UNLOADED = ["model.layers.3.mtp_block.mlp.gate.e_score_correction_bias: received no checkpoint value",
            "logits_processor / lm_head.weight: contains NaN",
            "model.layers.3.mtp_block.mlp.experts.w13_weight_scale_inv: holds finfo(float32).min "
            "(scale sentinel never loaded)",
            "model.layers.3.mtp_block.self_attn.o_proj.weight_scale_inv: received no checkpoint value"]


@pytest.mark.parametrize("argv", [["compare"], ["compare", "preset:small", "--steps", "1"], ["bisect-check"]])
def test_vllm_load_failure_is_a_bad_commit(argv, monkeypatch, capsys, tmp_path):
    from harness.production.module.audit import LoadAuditError

    _production_raises(monkeypatch, LoadAuditError(UNLOADED))
    code, lines, text = _run(capsys, *argv, "--report", tmp_path / "r.json")
    _assert_one_line(code, lines, text, 1, "vLLM load failed", "e_score_correction_bias", "lm_head.weight",
                     "w13_weight_scale_inv", "(+1 more)")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("exc", [RuntimeError("DeepGEMM: no kernel for sm_90a\nsecond line"),
                                 RuntimeError("TP=2 case c, rank 1: boom\nTraceback (most recent call last):\n  x"),
                                 ImportError("cannot import name 'HYV4MTP'"), KeyError("w13_weight")])
@pytest.mark.parametrize("command", ["compare", "bisect-check"])
def test_other_production_crash_cannot_be_judged(command, exc, monkeypatch, capsys):
    _production_raises(monkeypatch, exc)
    code, lines, text = _run(capsys, command)
    _assert_one_line(code, lines, text, 125, "cannot judge:", type(exc).__name__)


def test_tp_rank_load_failure_is_a_bad_commit(monkeypatch, capsys):
    """A LoadAuditError of a TP rank reaches the parent as a LoadAuditError (exit 1)."""
    import torch.cuda

    from harness.production import can_run
    from harness.commands import compare as compare_cli
    from harness.production.tp import multigpu
    from harness.production.module.audit import LoadAuditError

    class Workers:
        def __init__(self, tp):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    def run_case_tp(workers, case, **_):
        raise LoadAuditError([f"rank 1: {UNLOADED[0]}"])

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(multigpu, "TPWorkers", Workers)
    monkeypatch.setattr(multigpu, "run_case_tp", run_case_tp)
    assert compare_cli  # imported: the lazy import path of the CLI
    code, lines, text = _run(capsys, "compare", "--tp", "2")
    _assert_one_line(code, lines, text, 1, "vLLM load failed", "rank 1", "e_score_correction_bias")


# ---- other commands: bad arguments, bad files, write failures, unexpected errors -----------------

def _report_doc(**component):
    c = {"name": "step0.logits", "passed": True, "max_abs": 0.0, "max_rel": 0.0, "similarity_gap": 0.0,
         "tolerance": {"atol": 1e-3, "rtol": 0.0}}
    c.update(component)
    return {"meta": {}, "cases": {"c": {"components": [c]}}}


def _write_json(path: Path, doc) -> Path:
    path.write_text(json.dumps(doc))
    return path


ARGUMENT_CASES = [
    # (id, argv with {tmp} for the test's directory, culprits); every one exits 2
    ("unknown-command", ["frobnicate"], ["frobnicate"]),
    ("unknown-flag", ["reference", "preset:tiny", "--out", "{tmp}/o/t.safetensors", "--bogus"], ["--bogus"]),
    ("steps-not-int", ["compare", "--steps", "two"], ["--steps"]),
    ("unknown-preset", ["reference", "preset:nope", "--out", "{tmp}/o/t.safetensors"], ["nope"]),
    ("steps-zero", ["reference", "preset:tiny", "--out", "{tmp}/o/t.safetensors", "--steps", "0"], ["--steps"]),
    ("out-is-a-dir", ["reference", "preset:tiny", "--out", "{tmp}"], ["--out"]),
    ("reference-tp-3", ["reference", "preset:tiny", "--out", "{tmp}/o/t.safetensors", "--tp", "3"], ["--tp 3"]),
    ("compare-no-config", ["compare", "{tmp}"], ["no config.json"]),
    ("compare-tp-0", ["compare", "--tp", "0"], ["--tp"]),
    ("compare-tp-3", ["compare", "--tp", "3"], ["--tp 3", "num_attention_heads"]),
    ("compare-unknown-target", ["compare", "nonsense-case"], ["nonsense-case"]),
    ("compare-report-is-a-dir", ["compare", "--report", "{tmp}"], ["--report"]),
    ("bisect-unknown-case", ["bisect-check", "--case", "nope"], ["nope"]),
    ("bisect-report-is-a-dir", ["bisect-check", "--report", "{tmp}"], ["--report"]),
    ("report-missing", ["report", "{tmp}/nothing.json"], ["nothing.json"]),
    ("report-is-a-dir", ["report", "{tmp}"], ["is a directory"]),
    ("report-not-json", ["report", "{tmp}/notjson.json"], ["notjson.json"]),
    ("report-list", ["report", "{tmp}/list.json"], ["list.json", "cases"]),
    ("report-no-components", ["report", "{tmp}/nocomp.json"], ["nocomp.json", "components"]),
    ("report-component-field", ["report", "{tmp}/badfield.json"], ["badfield.json", "max_abs"]),
    ("report-passed-string", ["report", "{tmp}/passedstr.json"], ["passedstr.json", "passed"]),
    ("report-second-bad", ["report", "{tmp}/good.json", "{tmp}/list.json"], ["list.json"]),
    ("report-plot-dir-missing", ["report", "{tmp}/good.json", "--plot", "{tmp}/no/such/dir/p.png"], ["--plot"]),
    ("report-factor-nan", ["report", "{tmp}/good.json", "--factor", "nan"], ["--factor"]),
    ("synth-too-many-shards", ["synth", "{tmp}/o/ck", "--shards", "200"], ["--shards 200"]),
    ("synth-zero-shards", ["synth", "{tmp}/o/ck", "--shards", "0"], ["shards"]),
    ("synth-shards-without-index", ["synth", "{tmp}/o/ck", "--shards", "2", "--no-index"], ["index"]),
    ("synth-mtp-layers-0", ["synth", "{tmp}/o/ck", "--mtp-layers", "0"], ["num_nextn_predict_layers"]),
    ("synth-vocab-0", ["synth", "{tmp}/o/ck", "--vocab-size", "0"], ["vocab_size"]),
    ("synth-non-empty-dir", ["synth", "{tmp}"], ["not empty"]),
    ("mutants-unknown", ["mutants", "--only", "no-such-mutant"], ["no-such-mutant"]),
    ("mutants-budget-negative", ["mutants", "--budget-s", "-1"], ["--budget-s"]),
]


@pytest.mark.parametrize("case_id,argv,culprits", ARGUMENT_CASES, ids=[c[0] for c in ARGUMENT_CASES])
def test_bad_arguments_are_one_line_exit_2(case_id, argv, culprits, tmp_path, capsys, gpu_host):
    _write_json(tmp_path / "good.json", _report_doc())
    (tmp_path / "notjson.json").write_text("{")
    _write_json(tmp_path / "list.json", [1])
    _write_json(tmp_path / "nocomp.json", {"cases": {"c": {}}})
    _write_json(tmp_path / "badfield.json", _report_doc(max_abs="big"))
    _write_json(tmp_path / "passedstr.json", _report_doc(passed="yes"))
    before = _snapshot(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, lines, text = _run(capsys, *argv)
    _assert_one_line(code, lines, text, 2, *culprits)
    assert _snapshot(tmp_path) == before and not (tmp_path / "o").exists()


def test_engine_command_follows_the_contract(tmp_path, capsys, monkeypatch):
    from harness.production import can_run
    from harness.commands.engine import main as engine_main
    from harness.production.engine import generation_judge as engine
    engine_cases = case_registry.specs(kind="engine")

    case = sorted(engine_cases)[0]
    _assert_one_line(*_run(capsys, "--case", "no-such-case", main=engine_main), 2, "no-such-case")
    _assert_one_line(*_run(capsys, "--rejudge", tmp_path / "missing", main=engine_main), 2,
                     f"error: --rejudge {tmp_path / 'missing'}: not a directory")
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: None)
    monkeypatch.setattr(can_run, "cannot_run_engine_reason", lambda: None)
    _assert_one_line(*_run(capsys, "--case", case, "--out", tmp_path / "file", main=engine_main), 2,
                     "exists and is not a directory")
    # a crash inside vLLM: 125; a load failure: 1; each one line, the traceback only in the report
    from harness.production.module.audit import LoadAuditError

    for exc, want in ((RuntimeError("engine core died"), 125), (LoadAuditError(UNLOADED[:1]), 1)):
        def run_case(c, out=None, mutant=None, _e=exc):
            raise _e

        monkeypatch.setattr(engine, "run_case", run_case)
        out_dir = tmp_path / f"rep{want}"
        _assert_one_line(*_run(capsys, "--case", case, "--out", out_dir, main=engine_main), want,
                         type(exc).__name__ if want == 125 else "e_score_correction_bias")
        rep = json.loads(next(out_dir.glob("engine_mtp_*.json")).read_text())
        assert "Traceback" in rep["error"] and rep["exit_code"] == want


def _safetensors_disk_full(*a, **k):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")


def _oserror_disk_full(*a, **k):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("failure", [_safetensors_disk_full, _oserror_disk_full], ids=["SafetensorError", "ENOSPC"])
def test_disk_full_while_writing_leaves_nothing(failure, tmp_path, capsys, monkeypatch):
    import safetensors.torch

    from harness.checkpoint import synth

    monkeypatch.setattr(safetensors.torch, "save_file", failure)
    out = tmp_path / "deep" / "er" / "t.safetensors"
    code, lines, text = _run(capsys, "reference", "preset:tiny", "--out", out, "--tokens", "2", "--steps", "1")
    _assert_one_line(code, lines, text, 125, "cannot judge:", str(out), "write failed")
    assert not (tmp_path / "deep").exists() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(synth, "save_file", failure)
    code, lines, text = _run(capsys, "synth", tmp_path / "ck" / "x", "--shards", "2")
    _assert_one_line(code, lines, text, 125, "cannot judge:", "write failed")
    assert list(tmp_path.iterdir()) == []
    # an existing --out keeps its old content (the new one goes to a temp file first)
    old = tmp_path / "old.safetensors"
    old.write_bytes(b"previous trace")
    before = _snapshot(tmp_path)
    code, lines, text = _run(capsys, "reference", "preset:tiny", "--out", old, "--tokens", "2", "--steps", "1")
    _assert_one_line(code, lines, text, 125, "cannot judge:", "old.safetensors")
    assert _snapshot(tmp_path) == before


def test_plot_write_failure_is_one_line(tmp_path, capsys, monkeypatch):
    import matplotlib.figure

    def savefig(self, *a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    _write_json(tmp_path / "good.json", _report_doc())
    code, lines, text = _run(capsys, "report", tmp_path / "good.json", "--plot", tmp_path / "p.png")
    assert code == 125 and "Traceback" not in text and lines[-1].startswith("cannot judge:") and "p.png" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.json"]


def test_unexpected_harness_error_is_125_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    import reference

    def boom(*a, **k):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(reference, "draft", boom)
    argv = ["reference", "preset:tiny", "--out", str(tmp_path / "t.safetensors"), "--tokens", "2"]
    code, lines, text = _run(capsys, *argv)
    _assert_one_line(code, lines, text, 125, "unexpected harness error", "ZeroDivisionError", "--debug")
    code = cli_main(["--debug", *argv])
    out, err = capsys.readouterr()
    assert code == 125 and "Traceback" in err and err.strip().splitlines()[-1].startswith("cannot judge:")
    assert list(tmp_path.iterdir()) == []


def test_worst_of_several_exit_codes():
    from harness.exitcodes import worst

    assert worst([0, 0]) == 0 and worst([0, 125]) == 125 and worst([125, 1, 0]) == 1 and worst([1, 2]) == 2
    assert worst([0, -9]) == 125 and worst([0, 137]) == 125  # a killed child process cannot judge


# ---- goldens: their problems are named in one line, never a bare KeyError ----------------------

def test_golden_problems_are_named(tmp_path):
    import hashlib as _hashlib

    from harness.goldens import store

    store.write("reference", "c1", {"step0.logits": torch.zeros(2, 3, dtype=torch.float64)}, {"case": "c1"},
                  root=tmp_path)
    path = tmp_path / "reference" / "c1.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # a late one-byte edit
    path.write_bytes(bytes(data))
    now = _hashlib.sha256(bytes(data)).hexdigest()
    recorded = json.loads((tmp_path / "manifest.json").read_text())["cases"]["reference/c1"]["sha256"]
    with pytest.raises(store.GoldenError) as ei:
        store.load("reference", "c1", root=tmp_path)
    assert f"sha256 {now} != manifest {recorded}" in str(ei.value)  # full digests, never cut
    for doc in ({"meta": {}}, [], {"cases": []}, {"cases": {"reference/c1": "x"}}):
        (tmp_path / "manifest.json").write_text(json.dumps(doc))
        with pytest.raises(store.GoldenError, match="manifest.json: not a goldens manifest"):
            store.read_manifest(tmp_path)


@pytest.mark.parametrize("value,refused", [("true", True), ("TRUE", True), ("1", True), ("yes", True), ("Yes", True),
                                           ("on", True), ("", False), ("0", False), ("false", False), ("No", False),
                                           ("off", False), (None, False)])
def test_update_goldens_is_refused_whenever_ci_is_set(value, refused):
    from harness.ci_env import ci_is_set

    assert ci_is_set({} if value is None else {"CI": value}) is refused


def test_main_job_with_a_corrupt_golden_cannot_judge(monkeypatch, capsys):
    from harness.goldens import store
    from harness.production import can_run

    def load(kind, case_id, root=None):
        raise store.GoldenError(f"golden file goldens/{kind}/{case_id}.safetensors is corrupt or edited")

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    monkeypatch.setattr(store, "load", load)
    code, lines, text = _run(capsys, "main")
    assert code == 125 and "Traceback" not in text and any("is corrupt or edited" in line for line in lines), text


def test_report_write_failure_of_compare_and_bisect(tmp_path, monkeypatch):
    from harness import report
    from harness.exitcodes import CannotJudge, classify

    monkeypatch.setattr(report, "atomic_write_json", _oserror_disk_full)
    with pytest.raises(CannotJudge) as ei:
        report.save_report(tmp_path / "r.json", {}, {})
    code, line = classify(ei.value)
    assert code == 125 and "--report" in line and "r.json" in line and "No space left" in line


def test_a_return_value_outside_the_contract_cannot_judge(capsys):
    from harness.exitcodes import run_guarded

    assert run_guarded(lambda: None) == 125 and run_guarded(lambda: -9) == 125 and run_guarded(lambda: 1) == 1
    assert capsys.readouterr().out.count("cannot judge:") == 2


def test_interpreter_teardown_cannot_change_the_exit_code(tmp_path):
    """``python -m harness`` ends with the command's code once it has printed its verdict: an exit
    hook that would crash or exit differently at interpreter shutdown (as vLLM's and torch's
    teardown on a GPU host may) never runs, and the piped output is complete."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: (sys.stdout.write('teardown ran\\n'), sys.stdout.flush(), os._exit(99)))\n")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(root)])
    r = subprocess.run([sys.executable, "-m", "harness", "warmup", "--case", "nope"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --case nope: unknown"), (r.returncode, r.stderr)
    r = subprocess.run([sys.executable, "-m", "harness", "warmup", "--case", "tiny-k1"], cwd=root,
                       env={**env, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 125 and r.stdout.strip() == "cannot judge: warmup: no CUDA device", (r.returncode, r.stdout)
    assert "teardown ran" not in r.stdout
    r = subprocess.run([sys.executable, "-c", "print('plain python')"], env=env, capture_output=True, text=True)
    assert r.returncode == 99 and "teardown ran" in r.stdout  # the hook is live in a plain interpreter


@pytest.mark.parametrize("argv, culprit", [(("--steps", "0"), "--steps must be >= 1"),
                                           (("--tp", "3"), "--tp 3 does not divide num_attention_heads 4"),
                                           (("preset:nope",), "unknown preset 'nope'")])
def test_main_job_rejects_bad_input_on_a_host_without_a_gpu(monkeypatch, capsys, argv, culprit):
    """The main job's arguments are compare's: exit 2 on any machine, not ignored where the
    job falls back to the reference goldens (a GPU host already said 2)."""
    from harness.production import can_run

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    _assert_one_line(*_run(capsys, "main", *argv), 2, culprit)


def test_main_job_without_a_gpu_writes_its_report(tmp_path, monkeypatch, capsys):
    """``main --report`` where the job falls back to the reference goldens: the judged cases'
    reports in compare's format (``harness report`` reads it), not silently nothing."""
    from harness.production import can_run
    from harness.report import read_report

    monkeypatch.setattr(can_run, "cannot_run_production_reason", lambda: "no CUDA device")
    code, lines, text = _run(capsys, "main", "--report", tmp_path / "r.json")
    assert code == 0, text
    doc = read_report(tmp_path / "r.json")
    assert sorted(doc["cases"]) == sorted(case_registry.ids(role="golden", kind="reference"))
    assert doc["meta"]["job"].startswith("reference vs goldens")
    (tmp_path / "a-file").write_text("x")
    code, lines, text = _run(capsys, "main", "--report", tmp_path / "a-file" / "r.json")
    assert code == 2 and "--report" in lines[-1] and "Traceback" not in text, text


# ---- bad input and "cannot judge" without importing torch -------------------------------------------
@pytest.mark.parametrize("argv, code, line", [
    (["-m", "harness", "reference", "preset:nope", "--out", "{tmp}/x.safetensors"], 2,
     "error: unknown preset 'nope'; choose one of tiny, small, real-dims"),
    (["-m", "harness", "reference", "preset:tiny", "--out", "{tmp}/x.safetensors", "--device", "cuda",
      "--steps", "0"], 2, "error: --steps, --requests, --tokens and --tp must be >= 1"),
    (["-m", "harness", "engine", "--mutant", "nope"], 2, "error: --mutant nope: unknown speculator mutant"),
    (["-m", "harness", "engine", "--sweep"], 2, "error: --sweep needs exactly one --case"),
    (["-m", "harness", "engine", "--case", "engine-tiny-k2"], 125, "cannot judge: no CUDA device"),
])
def test_answered_before_torch_is_imported(tmp_path, argv, code, line):
    """These answers need no torch: a torch that ends the process with exit 99 when imported
    is first on the path, and the commands still answer (a real entry point each)."""
    import subprocess
    import sys

    from harness.production.can_run import gpu_device_nodes

    if gpu_device_nodes():
        pytest.skip("a GPU host: the engine command goes on to import torch")
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise SystemExit(99)\n")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), str(root)])}
    env.pop("HYV4_JIT_CACHE", None)
    r = subprocess.run([sys.executable, *[a.format(tmp=tmp_path) for a in argv]], env=env, cwd=root,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert line in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("flags", [("--steps", "3"), ("--seed", "7"), ("--steps", "3", "--seed", "7")])
def test_compare_refuses_steps_and_seed_with_a_case_id(capsys, flags):
    """A case id fixes its steps and seed: ``--steps`` / ``--seed`` with one are exit 2 in one
    line naming them (never silently dropped), on any machine; a preset takes them."""
    from harness.cli import build_parser
    from harness.commands.compare import _case_for, validate_args
    gpu_cases = case_registry.specs(kind="module", without="probe")
    engine_cases = case_registry.specs(kind="engine")

    for cid in (next(iter(gpu_cases)), next(iter(engine_cases))):
        _assert_one_line(*_run(capsys, "compare", cid, *flags), 2, cid, flags[0])
    args = build_parser().parse_args(["compare", "preset:tiny", *flags])
    validate_args(args)
    case = _case_for(args)
    assert case.steps == (3 if "--steps" in flags else 2) and case.seed == (7 if "--seed" in flags else 0)
