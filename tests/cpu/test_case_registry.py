"""The case registry (``harness.case_registry``), the one list of cases: the invariants its queries
keep (no case id is pinned here: adding a case is its record, plus its goldens where it is a golden
case), and the records checking themselves (a bad record fails when it is built, saying what to do)."""

from __future__ import annotations

import dataclasses
import re
import pathlib

import pytest

from harness import case_registry as reg
from harness.case_specs import Case, EngineCase, GpuCase
from harness.record_checks import RecordError

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_ids_are_unique_and_every_record_is_of_a_known_kind_with_its_spec_type():
    every = [r.id for r in reg.REGISTRY]
    assert len(every) == len(set(every)) == len(reg.BY_ID), sorted(i for i in every if every.count(i) > 1)
    for r in reg.REGISTRY:
        assert r.kind in reg.KINDS and type(r.spec) is reg.SPEC_TYPES[r.kind], r.id
        assert r.roles <= set(reg.ROLES) and all(r.kind in reg.ROLE_KINDS[role] for role in r.roles), r.id
    used = set().union(*(r.roles for r in reg.REGISTRY))
    assert used == set(reg.ROLES), f"roles no case has: {set(reg.ROLES) - used}"


def test_every_case_is_reachable_by_a_command_or_a_test():
    """Reference cases are run as goldens; every single-GPU module case by side_by_side's default
    (tests/gpu/test_side_by_side.py: the non-probe ones; the probes by name) and every engine case
    by tests/gpu/test_engine_mtp.py (a case speculator mutants are swept on: by its sweep's first
    pristine run, tests/gpu/test_speculator_mutants.py); a case written for N > 1 GPUs by the
    multi-GPU test (role tp)."""
    for r in reg.REGISTRY:
        if r.kind == "reference":
            assert "golden" in r.roles, r.id
        if r.gpus > 1:
            assert "tp" in r.roles and r.kind == "module", r.id
    assert set(reg.ids()) | set(reg.ids(role="tp", max_gpus=max(r.gpus for r in reg.REGISTRY))) == set(reg.BY_ID)
    assert reg.ids(kind="module") == (*reg.ids(kind="module", without="probe"), *reg.ids(role="probe"))


def test_every_golden_case_has_its_goldens_on_disk():
    for kind, folder in (("reference", "reference"), ("module", "production")):
        for cid in reg.ids(role="golden", kind=kind):
            assert (REPO / "goldens" / folder / f"{cid}.safetensors").is_file(), (kind, cid)


def test_bisect_sets_are_of_the_right_kind_and_their_order_is_declared():
    # bisect-check's default set: eager engine cases, then the goldens' side-by-side cases (the same
    # set: a case of the one without the other would be judged against the reference only)
    assert {r.kind for r in reg.records(role="bisect")} == {"module", "engine"}
    assert not any(r.spec.graphs for r in reg.records(role="bisect", kind="engine"))
    assert all(r.spec.graphs for r in reg.records(role="graph-bisect"))
    assert reg.ids(role="golden", kind="module") == reg.ids(role="bisect", kind="module")
    for role in ("bisect", "golden", "tp"):  # report / table / test order: positions given, none shared
        positions = [r.position(role) for r in reg.records(role=role, kind="module", max_gpus=8)]
        assert all(role in dict(r.order) for r in reg.records(role=role, kind="module", max_gpus=8)), role
        assert len(positions) == len(set(positions)), (role, positions)
    # the roles bisect-check adds: module cases of their base role, judged against the reference only
    reference_only = set(reg.ids(role="reference-bisect"))
    assert set(reg.ids(role="ct-bisect")) <= reference_only & set(reg.ids(role="compressed-tensors"))
    assert set(reg.ids(role="reload-bisect")) <= reference_only & set(reg.ids(role="reload"))
    assert not reference_only & set(reg.ids(role="golden"))


def test_claimed_regimes_presets_and_patterns_are_known():
    """What the records cannot check at import (the lists live in torch-importing modules)."""
    from harness import regimes
    from harness.presets import PRESETS
    from harness.production.engine.acceptance import PATTERNS

    for r in reg.records(max_gpus=8):
        assert set(r.regimes) <= set(regimes.REGIMES), (r.id, set(r.regimes) - set(regimes.REGIMES))
        assert r.spec.preset in PRESETS, (r.id, r.spec.preset)
        if r.kind == "engine":
            assert set(r.spec.patterns) <= set(PATTERNS), r.id
    claimed = {g for r in reg.REGISTRY for g in r.regimes}
    assert claimed and all(regimes.REGIMES[g].threshold is not None for g in claimed)


def test_role_lists_state_what_their_cases_are():
    single_module = reg.records(kind="module")
    # (a reload case of an FP8 checkpoint is in role "reload", not "fp8")
    assert reg.ids(role="fp8") == tuple(r.id for r in single_module if r.spec.quant in ("fp8", "fp8-ue8m0")
                                        and r.spec.reload_seed is None)
    assert reg.ids(role="compressed-tensors") == tuple(r.id for r in single_module
                                                       if r.spec.quant.startswith("compressed-tensors"))
    assert reg.ids(role="modelopt") == tuple(r.id for r in single_module if r.spec.quant == "modelopt-fp8-pb")
    assert reg.ids(role="reload") == tuple(r.id for r in reg.REGISTRY
                                           if getattr(r.spec, "reload_seed", None) is not None)
    # a known vLLM gap is declared only where the case exists to show it (a compressed-tensors case)
    assert all("compressed-tensors" in r.roles for r in single_module if r.spec.upstream_gaps)
    # fp8-kv: exactly the cases served with an FP8 KV cache, module and engine (eager and CUDA graphs)
    assert reg.ids(role="fp8-kv") == tuple(r.id for r in reg.REGISTRY
                                           if getattr(r.spec, "kv_cache_dtype", "auto") != "auto")
    assert {r.kind for r in reg.records(role="fp8-kv")} == {"module", "engine"}
    assert {r.spec.graphs for r in reg.records(role="fp8-kv", kind="engine")} == {False, True}
    for r in reg.records(role="fp8-kv", kind="module"):  # contexts longer than index_topk (128)
        assert r.spec.tokens > 128, r.id


def test_queries_refuse_unknown_roles_kinds_and_ids():
    with pytest.raises(KeyError, match="unknown role 'no-such-role'; known: golden"):
        reg.ids(role="no-such-role")
    with pytest.raises(KeyError, match="unknown kind"):
        reg.ids(kind="no-such-kind")
    with pytest.raises(KeyError, match="unknown case 'nope'; known: tiny-"):
        reg.spec("nope", kind="reference")
    some = reg.REGISTRY[0]
    assert reg.spec(some.id) is some.spec is reg.BY_ID[some.id].spec
    assert all(dataclasses.is_dataclass(s) for s in reg.specs().values())


def test_no_module_keeps_a_view_of_the_registry():
    """The registry's queries are the only lists: no module imports a case list under a view's name
    (the views and their modules were folded away; a new one would be a second list to keep)."""
    users = []
    for path in [*REPO.joinpath("harness").rglob("*.py"), *REPO.joinpath("tests").rglob("*.py"),
                 *REPO.joinpath("benchmarks").rglob("*.py")]:
        rel = path.relative_to(REPO).as_posix()
        if rel == "tests/cpu/test_case_registry.py":
            continue
        text = path.read_text()
        for needle in (r"production\.cases import", r"engine\.cases import", r"\b(GOLDEN|GPU|ENGINE|PROBE)_CASES\b",
                       r"harness\.cases import", r"from harness import cases\b"):
            if re.search(needle, text):
                users.append((rel, needle))
    assert not users, users


# ---- a bad record fails when it is built, naming the case and what to do --------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: reg.CaseRecord("module", GpuCase("x"), frozenset({"no-such-role"})),
     "case 'x': roles='no-such-role' is not one of 'golden', .*; declare a new role in Role, ROLES and ROLE_KINDS"),
    (lambda: reg.CaseRecord("gpu", GpuCase("x")), "case 'x': kind='gpu' is not one of 'reference', 'module', 'engine'"),
    (lambda: reg.CaseRecord("engine", GpuCase("x")), "kind 'engine' takes a EngineCase spec, not GpuCase"),
    (lambda: reg.CaseRecord("reference", Case("x", "tiny"), frozenset({"bisect"})),
     "role 'bisect' is for kind module / engine cases, not 'reference'"),
    (lambda: reg.CaseRecord("module", GpuCase("x", quant="fp8"), frozenset({"modelopt"})),
     "role 'modelopt' needs quant in .*, not 'fp8'; fix the quant or drop the role"),
    (lambda: reg.CaseRecord("module", GpuCase("x", reload_seed=3)), 'role "reload" goes with a reload_seed'),
    (lambda: reg.CaseRecord("module", GpuCase("x"), gpus=2), 'gpus=2; give 1, or N > 1 for a case of role "tp"'),
    (lambda: reg.CaseRecord("module", GpuCase("x"), frozenset({"bisect"}), order=(("golden", 0),)),
     "order's roles='golden' is not one of 'bisect'"),
    (lambda: reg.CaseRecord("engine", EngineCase("x", graphs=True)),
     "graph_regimes are declared exactly on CUDA-graph"),
    (lambda: reg.CaseRecord("engine", EngineCase("x", target="acceptance", patterns=("accept",))),
     "one pattern per prompt"),
    (lambda: GpuCase("x", quant="fp9"), "module case 'x': quant='fp9' is not one of 'bf16', .*QUANTS"),
    (lambda: GpuCase("x", experts="grouped"), "module case 'x': experts='grouped' is not one of 'split', 'fused'"),
    (lambda: GpuCase("x", kv_cache_dtype="fp16"), "kv_cache_dtype='fp16' is not one of 'auto', 'fp8'"),
    (lambda: EngineCase("x", target="real"), "engine case 'x': target='real' is not one of 'dummy', 'acceptance'"),
    (lambda: EngineCase("x", graphs=True, graph_regimes=("warp_speed",)),
     "graph_regimes='warp_speed' is not one of .*; name a regime of harness.production.engine.graph_regimes"),
    (lambda: Case("x", "tiny", overrides=("vocab_size", 512)), "overrides must be a tuple of .* pairs"),
])
def test_a_bad_case_record_fails_when_built_saying_what_to_do(build, message):
    with pytest.raises(RecordError, match=message):
        build()


def test_the_other_registries_check_their_records_when_built():
    from harness.components import Component, Hook
    from harness.mutants.base import Planted
    from harness.production.engine.speculator_mutants import SpeculatorMutant

    cases = [
        (lambda: Hook("mlp", kind="backward"), "hook on 'mlp': kind='backward' is not one of 'out', 'in'"),
        (lambda: Hook("mlp", transform="relu"), "transform='relu' is not one of 'sigmoid', 'flatten-heads', None"),
        (lambda: Component("x", "reference.x", compare="cosine"), "component 'x': compare='cosine' is not one of"),
        (lambda: Component("x", "reference.x", tp="column"), "tp='column' is not one of 'replicated'"),
        (lambda: Planted("p", "why", "tiny-k1", lambda ctx: None, "speculator"),
         "planted bug 'p': group='speculator' is not one of 'loading', .*; add the group to MutantGroup"),
        (lambda: Planted("p", "why", "no-such-case", lambda ctx: None, "moe"),
         "planted bug 'p': case='no-such-case' is not one of .*; declare the case in harness/case_registry.py"),
        (lambda: Planted("p", "why", "tiny-k1", lambda ctx: None, "moe", cpu_check="rope"),
         "cpu_check and cpu_apply go together"),
        (lambda: SpeculatorMutant("m", "engine-nope", "attn.topk", "what"),
         "speculator mutant 'm': case='engine-nope' is not one of"),
        (lambda: SpeculatorMutant("m", "engine-accept-k3-share", "x", "what",
                                  passes_eager="engine-graphs-accept-k3-share"),
         "a capture-only bug .* runs on a CUDA-graph case and passes on an eager one"),
    ]
    for build, message in cases:
        with pytest.raises(RecordError, match=message):
            build()


def test_case_inputs_are_built_once_and_equal_the_cached_ones(tmp_path):
    """``build_inputs`` gives what ``case_inputs`` gives (bitwise) plus the config and first step;
    a checkpoint directory's already loaded checkpoint is used as given, not read again."""
    import torch

    import reference as R
    from harness.checkpoint.loader import load_checkpoint
    from harness.checkpoint.synth import write_synthetic
    from harness.production.case_inputs import build_inputs, case_inputs

    case = reg.spec("tiny-k1", kind="module")
    inputs = build_inputs(case)
    hf, ckpt, weights = case_inputs(case)
    assert inputs.hf_config == hf and inputs.config == R.MTPConfig.from_hf_dict(hf)
    for mine, theirs in ((inputs.checkpoint, ckpt), (inputs.weights, weights)):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    first = R.make_case(inputs.config, case.seed, case.requests, case.tokens)
    assert all(torch.equal(getattr(inputs.first, f), getattr(first, f)) for f in ("input_ids", "positions", "hidden"))

    path = write_synthetic(str(tmp_path / "ckpt"), hf, weights)
    loaded = load_checkpoint(path)
    on_disk = GpuCase("ckpt-test", ckpt_dir=path, requests=2, tokens=16)
    given = build_inputs(on_disk, loaded=loaded)
    assert given.hf_config is loaded.hf_config
    assert given.config == R.MTPConfig.from_hf_dict(loaded.hf_config)
