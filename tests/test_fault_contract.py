"""The fault contract: the checker proves itself. For every op in OPS, every engine fault (a deliberately
wrong forward or backward, ``Fault.engine``) is detected on a small example scenario of that op, on every
built-in engine, and fails only the checks its record names (``Fault.caught_by``); and the negative-control
matrix of every shipped config misses no applicable fault. This is the one module that runs the matrix."""
import pytest

from gradcheck_cli import checker, scenario
from gradcheck_cli.ops import FAULTS, OPS

from helpers import CONFIGS, load_config, make

# The built-in engines engine faults apply to, as scenario keys; an op of one engine checks on it alone.
# The tiled engine gets blocks smaller than the example, so that its faults cross block boundaries.
ENGINES = {"attention": {"naive": {}, "tiled": dict(engine="tiled", block_q=2, block_k=4),
                         "torch": dict(backend="torch")}}
# Checks a fault may fail besides its record's: an engine's cross-checks against independent implementations
# (the tiled engine against the naive one, the torch engine against autograd and SDPA, and in float16/bfloat16
# against the float64 reference). They are not named in the records; the tests require a check the record
# names to catch the fault as well.
CROSS_CHECKS = {"tiled": {"tiled agrees with the naive engine"},
                "torch": {"autograd agrees", "SDPA agrees", "low-precision error within factor of plain"}}
AGREEMENT = set().union(*CROSS_CHECKS.values())


def _example(op, engine="naive", fault=None):
    """The op's example on that engine (checking the JVP for a fault of the JVP, the double backward for one of the
    HVP); skips on backend torch where torch is not installed."""
    if engine == "torch":
        pytest.importorskip("torch")
    derivative = FAULTS[fault].derivative if fault is not None else "vjp"
    mode = {"check": {"mode": derivative}} if derivative in ("jvp", "hvp") else {}
    needs = dict(FAULTS[fault].scenario) if fault is not None else {}  # a variant's key (softcap: ...)
    return make(**{"op": op, **OPS[op].example, **needs, **ENGINES.get(op, {}).get(engine, {}), **mode})


def _engine_faults(op):
    return {name for name, record in OPS[op].faults.items() if record.engine}


def borrowed(op, fault):
    """True when ``op`` composes another op that registers ``fault`` (block composes attention, RoPE, ...):
    the record's caught_by then names the part's checks (gradient q), not the composite's (gradient w_q),
    so on the composite the fault is required to be detected, not to fail only the named checks."""
    return any(other != op and fault in _engine_faults(other) and _borrowable(other) <= _engine_faults(op)
               for other in OPS)


def _borrowable(op):
    """The engine faults a composite borrows from its part: those of the forward and the VJP (a composite has
    no JVP of its own), of plain attention (not a score stage's, whose key only the part has)."""
    return {name for name in _engine_faults(op) if OPS[op].faults[name].derivative == "vjp"
            and not OPS[op].faults[name].scenario}


def _cases():
    cases = []
    for op_name, op in sorted(OPS.items()):
        for engine in sorted(ENGINES.get(op_name, {"naive": {}})):
            for fault, record in sorted(op.faults.items()):
                # a fault of the JVP or HVP applies on the engines that compute one (``Op.directional_derivative``)
                computes = op.directional_derivative(record.derivative)
                backend = ENGINES.get(op_name, {}).get(engine, {}).get("backend", "numpy")
                if record.backends and backend not in record.backends:  # a bias's gradient: NumPy engines for now
                    continue
                if dict(record.scenario).get("distributed") is not None and engine != "naive":
                    continue  # a context-parallel fault runs on the ranks, whatever the engine key says: once
                if record.engine and (computes is None or engine in computes[0]):
                    # on real ranks (two sets: the scenario's and one rank's), seconds each: with the slow tests
                    # (the default run checks the built-in ring and one fault in test_attention_distributed)
                    ranks = dict(record.scenario).get("distributed") is not None
                    cases.append(pytest.param(op_name, engine, fault, id=f"{op_name}-{engine}-{fault}",
                                              marks=(pytest.mark.slow,) if ranks else ()))
    return cases


def _failed(result):
    return {c.name for c in result.checks if c.verdict == "fail"}


def test_every_op_declares_an_example():
    """``Op.example``: the scenario keys the contract checks each op on."""
    assert all(op.example for op in OPS.values()), [name for name, op in OPS.items() if not op.example]
    assert set(ENGINES) <= set(OPS)
    # the JVP faults run on every engine that computes a JVP (the tiled one included)
    assert all(set(op.tangent_engines) <= set(ENGINES.get(name, {"naive": {}})) for name, op in OPS.items())
    assert {"naive", "tiled"} <= set(OPS["attention"].tangent_engines)


def _engines():
    return [pytest.param(op_name, engine, id=f"{op_name}-{engine}")
            for op_name in sorted(OPS) for engine in sorted(ENGINES.get(op_name, {"naive": {}}))]


@pytest.mark.parametrize("op, engine", _engines())
def test_each_example_passes_clean(op, engine):
    result = checker.run_scenario(_example(op, engine))
    assert result.passed, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("op, engine, fault", _cases())
def test_each_engine_fault_is_detected_and_fails_only_the_checks_its_record_names(op, engine, fault):
    sc = _example(op, engine, fault)
    assert fault in checker.applicable_faults(sc)
    failed = _failed(checker.run_scenario(sc, (fault,))) - CROSS_CHECKS.get(engine, set())
    assert failed, f"{fault} missed on the {op} example ({engine})"
    if not borrowed(op, fault):
        assert failed <= set(FAULTS[fault].caught_by), failed - set(FAULTS[fault].caught_by)


def test_ownership_of_the_faults():
    """Each engine fault belongs to exactly one op that does not borrow it (the one whose checks its record
    names); composites borrow their parts' faults."""
    for fault in (name for name, f in FAULTS.items() if f.engine):
        owners = [op for op in OPS if fault in _engine_faults(op) and not borrowed(op, fault)]
        assert len(owners) == 1, (fault, owners)
    assert borrowed("block", "softmax-term") and borrowed("block", "head-merge") and borrowed("block", "rope-transpose")
    assert borrowed("attention-projections", "softmax-term") and not borrowed("attention-projections", "head-merge")


def test_faults_of_a_derivative_apply_only_where_it_is_checked():
    """A fault of the JVP is not applicable to a scenario that checks the gradients, nor one of the VJP to a
    scenario that checks the JVP; forward faults apply to both."""
    vjp, jvp = _example("attention"), _example("attention", fault="jvp-centring")
    jvp_faults = {f for f, r in FAULTS.items() if r.derivative == "jvp"}
    assert jvp_faults and not jvp_faults & set(checker.applicable_faults(vjp))
    assert set(checker.applicable_faults(jvp)) == jvp_faults | {"mask"}


@pytest.mark.parametrize("dtype, variant", [("float32", {}), ("float16", {}), ("bfloat16", {}),
                                            ("float32", {"softcap": 1.5}), ("bfloat16", {"softcap": 1.5})])
def test_every_engine_fault_is_caught_in_every_torch_precision(dtype, variant):
    """backend: torch in low precision: the reference checks (agreement with float64) keep the power; with
    soft-capping too (its faults apply then, and only then)."""
    pytest.importorskip("torch")
    sc = make(backend="torch", dtype=dtype, batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=8, d_head=8, scale=0.4,
              mask={"causal": "lower-right", "key_lengths": [8, 6]}, **variant)
    assert checker.run_scenario(sc).passed
    cells = checker.negative_controls([sc])
    assert {c.status for c in cells} == {"detected"}, [(c.fault, c.status) for c in cells]
    assert {c.fault for c in cells} == set(checker.applicable_faults(sc)) == set(OPS["attention"].faults) & {
        f for f, r in FAULTS.items() if r.engine and r.derivative == "vjp" and set(dict(r.scenario)) <= set(variant)}


def test_every_fault_name_is_one_record():
    """An op that composes others (block) registers their very faults; a name never means two things."""
    for op in OPS.values():
        for name, fault in op.faults.items():
            assert FAULTS[name] is fault, (op.name, name)


def test_block_catches_every_fault_of_its_parts():
    parts = ("attention", "attention-projections", "rope", "rmsnorm", "swiglu")
    assert set(OPS["block"].faults) == {f for op in parts for f in _borrowable(op)}


# The shipped configs: each passes clean, and its negative-control matrix misses no applicable fault.

@pytest.fixture(scope="module")
def matrix():
    """(op, cell) for every cell of every shipped config's negative-control matrix."""
    cells = []
    for path in CONFIGS:
        try:
            scs = load_config(path)
        except pytest.skip.Exception:
            continue
        ops = {sc.name: sc.op for sc in scs}
        cells += [(ops[c.scenario], c) for c in checker.negative_controls(scs)]
    return cells


@pytest.mark.slow  # tests/cli/test_commands.py runs every shipped config by default, through the CLI (exit 0)
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_passes_clean(path):
    for sc in load_config(path):
        result = checker.run_scenario(sc)
        assert result.passed, [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]


@pytest.mark.slow  # every fault on every shipped scenario: the module-scoped matrix, ~30 s
def test_no_applicable_fault_is_missed_on_any_shipped_config(matrix):
    missed = [(c.fault, c.scenario) for _, c in matrix if c.status == "missed"]
    assert not missed


@pytest.mark.slow
def test_faults_detected_on_shipped_configs_fail_only_the_checks_their_records_name(matrix):
    wrong = [(c.fault, c.scenario, set(c.caught_by) - set(FAULTS[c.fault].caught_by) - AGREEMENT)
             for op, c in matrix if c.status == "detected" and not borrowed(op, c.fault)]
    assert not [w for w in wrong if w[2]], wrong


@pytest.mark.slow
def test_every_engine_fault_is_applicable_and_detected_somewhere(matrix):
    detected = {c.fault for _, c in matrix if c.status == "detected"}
    assert detected == {name for name, f in FAULTS.items() if f.engine}


def test_no_fault_is_missed_when_shipped_configs_run_on_the_tiled_engine(root):
    for name in ("seed-causal-first-row.yaml", "sweep.yaml"):
        scs = scenario.with_engine(scenario.load(root / "configs" / name), "tiled")
        assert not [(c.fault, c.scenario) for c in checker.negative_controls(scs) if c.status == "missed"]
