"""Fingerprints of known mistakes (gradcheck_cli/fingerprints.py): a table of hand-written buggy backwards
(tests/bugs/dense_bugs.py, written as their authors would, not through the tool's formulas), each of which must fail
and be named by its cause and by no other; the correct ones pass with no cause named. And the matching rule itself:
a candidate that explains the failed tensors but not a passing one, or that equals the correct backward, is never
named."""
import numpy as np
import pytest
import yaml

from gradcheck_cli import checker, fingerprints, scenario
from gradcheck_cli.diagnose import Evidence

from helpers import ROOT

BUGS_DIR = ROOT / "tests" / "bugs"


def _named(hints) -> set[str]:
    import re
    return {m for h in hints for m in re.findall(r"`([a-z0-9-]+)`", h)}


#: The modules of hand-written bugs in tests/bugs/.
TABLES = ("dense_bugs", "infonce_bugs", "projections_bugs")


def _run(module: str, cls: str, keys: dict):
    doc = {"scenarios": [{"name": cls, **keys, "implementation": f"{module}:{cls}_"}]}
    return checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=BUGS_DIR)[0])


def _table():
    import importlib.util
    rows = []
    for name in TABLES:
        spec = importlib.util.spec_from_file_location(f"{name}_table", BUGS_DIR / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        rows += [(name, *row) for row in module.BUGS]
    return rows


@pytest.mark.parametrize("module, cls, cause, keys", _table(), ids=[row[1] for row in _table()])
def test_each_hand_written_bug_is_named_by_its_cause_and_no_other(module, cls, cause, keys):
    result = _run(module, cls, keys)
    named = _named(result.hints)
    if cause is None:
        assert result.verdict.value == "pass" and not named, result.hints
        return
    assert result.verdict.value == "fail"
    assert named == ({cause} if isinstance(cause, str) else set(cause)), result.hints


@pytest.mark.slow  # ~2 s each (torch's and JAX's imports and compiles); the NumPy tables above run by default
@pytest.mark.parametrize("module, library", [("torch_bugs", "torch"), ("jax_bugs", "jax")])
def test_torch_and_jax_bugs_are_named_by_their_cause_and_no_other(module, library):
    """The same table's rule in the torch flavour (custom autograd Functions, detached statistics) and the JAX
    flavour (custom_vjp)."""
    pytest.importorskip(library)
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"{module}_table", BUGS_DIR / f"{module}.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    for function, cause, keys in table.BUGS:
        doc = {"scenarios": [{"name": function, **keys, "implementation": f"{module}:{function}"}]}
        result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=BUGS_DIR)[0])
        if cause is None:
            assert result.verdict.value == "pass" and not _named(result.hints), (function, result.hints)
        else:
            assert result.verdict.value == "fail" and _named(result.hints) == {cause}, (function, result.hints)


def _evidence(analytic, numeric, allowed=1e-6):
    return Evidence(np.asarray(analytic, float), np.asarray(numeric, float), np.full(np.shape(analytic), allowed))


def test_a_candidate_is_named_only_when_it_explains_every_checked_tensor():
    right = {"x": np.array([1.0, 2.0, 3.0]), "w": np.array([4.0, 5.0])}
    wrong_x = {"x": np.array([1.0, 2.5, 3.0]), "w": right["w"]}
    wrong_both = {"x": wrong_x["x"], "w": np.array([4.0, 6.0])}
    evidence = {"x": _evidence(wrong_x["x"], right["x"]), "w": _evidence(right["w"], right["w"])}
    cands = [fingerprints.Candidate("x-only", "x wrong", lambda: wrong_x),
             fingerprints.Candidate("both", "x and w wrong", lambda: wrong_both),
             fingerprints.Candidate("none", "changes nothing", lambda: right)]
    hints = fingerprints.named(evidence, {"x"}, cands, right)
    assert _named(hints) == {"x-only"}
    assert fingerprints.named(evidence, set(), cands, right) == []
    # the user's forward is what is wrong: its analytic gradient is the correct one; no candidate may claim it
    evidence = {"x": _evidence(right["x"], wrong_x["x"]), "w": _evidence(right["w"], right["w"])}
    assert fingerprints.named(evidence, {"x"}, cands, right) == []


def test_two_candidates_that_coincide_are_named_together():
    right = {"x": np.array([1.0, 2.0])}
    wrong = {"x": np.array([1.0, 3.0])}
    evidence = {"x": _evidence(wrong["x"], right["x"])}
    hints = fingerprints.named(evidence, {"x"}, [fingerprints.Candidate("a", "A", lambda: wrong),
                                                 fingerprints.Candidate("b", "B", lambda: wrong)], right)
    assert _named(hints) == {"a", "b"} and "one of these" in hints[0]


def test_a_tensor_autograd_gave_no_gradient_is_said_in_those_words(tmp_path):
    torch = pytest.importorskip("torch")
    del torch
    from helpers import with_code
    source = ("import torch\n"
              "def rms(x, gamma, eps):\n"
              "    r = torch.sqrt((x * x).mean(-1, keepdim=True) + eps)\n"
              "    return gamma.detach() * x / r\n")
    sc = with_code(tmp_path, source, "rms", op="rmsnorm", backend="torch", batch=2, n=3, d_model=8)
    result = checker.run_scenario(sc)
    assert result.verdict.value == "fail"
    assert any("autograd returned no gradient for gamma" in h for h in result.hints), result.hints


@pytest.mark.parametrize("config", ["rmsnorm", "layernorm", "swiglu", "rope", "infonce"])
def test_every_gradient_fault_injected_into_user_code_is_named_by_its_own_name(config):
    """A fault that adds its change to a user's gradients (``user_engine.ADDED``) makes them exactly that wrong
    backward: the report must name it, and no other cause, on each example scenario of the op's (float64 and
    float32 alike)."""
    from gradcheck_cli.ops import OPS
    from gradcheck_cli.ops.user_engine import ADDED
    for sc in scenario.load(ROOT / "examples" / f"{config}.yaml"):
        faults = [name for name, f in OPS[sc.op].faults.items() if f.user == ADDED and not f.sized]
        assert faults
        for fault in faults:
            result = checker.run_scenario(sc, (fault,))
            if result.verdict.value != "fail":  # a fault that changes nothing on this scenario (its contract says)
                continue
            assert _named(result.hints) == {fault}, (sc.name, fault, result.hints)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["attention", "softcap", "alibi", "sinks", "bias", "lse", "relative_bias"])
def test_every_attention_gradient_fault_in_user_code_gets_a_cause_and_a_fingerprint_names_only_it(config):
    """Attention's own hints name most of its backward faults by their patterns; where none does, the fingerprint
    does. Injected into the NumPy examples of each variant: every failing run names a cause, and a fingerprint, when
    one is given, names the injected fault alone."""
    from gradcheck_cli.ops import OPS
    from gradcheck_cli.ops.attention.formulas import _ADDED
    sc = next(s for s in scenario.load(ROOT / "examples" / f"{config}.yaml") if s.backend == "numpy")
    tried = 0
    for fault, f in OPS["attention"].faults.items():
        if f.user != _ADDED or f.sized:
            continue
        result = checker.run_scenario(sc, (fault,))
        if result.verdict.value != "fail":
            continue
        tried += 1
        assert result.hints, (config, fault)
        assert _named(result.hints) <= {fault}, (config, fault, result.hints)
    assert tried


#: Attention bugs whose hint once named a wrong or misleading cause (a cold trial by a helper): (object in
#: tests/bugs/attention_bugs.py, scenario keys, words the hint must say, words it must not).
ATTENTION_CASES = [
    ("softcap_over_c", {"softcap": 1.5, "scale": 0.9}, "it is 1/softcap", "scale factor in the backward"),
    ("softcap_over_c", {"softcap": 4.0, "scale": 0.9}, "it is 1/softcap", "scale factor in the backward"),
    ("alibi_slope_abs", {"heads_q": 6, "heads_kv": 3, "alibi": {"slopes": "geometric", "grad": True}},
     "`alibi-slope-grad-sign`", "a constant factor"),
    ("gqa_mean", {"heads_q": 4, "heads_kv": 2}, "averaged into their KV head's gradient instead of summed",
     " alone"),
    ("gqa_mean", {"heads_q": 8, "heads_kv": 2}, "1/4 x", " alone"),
    # once no cause at all
    ("dv_no_transpose", {"heads_q": 4, "heads_kv": 2, "n_q": 7, "n_k": 7, "mask": {"causal": "lower-right"}},
     "`dv-untransposed`", "a constant factor"),
    ("mask_bwd_upper_left", {"heads_q": 4, "heads_kv": 2, "n_q": 4, "n_k": 9, "mask": {"causal": "lower-right"}},
     "`mask-backward-alignment`", "a constant factor"),
    # the kinds a second cold trial found unnamed, and their correct twin
    ("hooked", {"heads_q": 4, "heads_kv": 2, "n_k": 9, "mask": {"causal": "lower-right", "key_lengths": [9, 7]}},
     None, "`"),
    ("mask_bwd_causal_only", {"heads_q": 4, "heads_kv": 2, "n_k": 9,
                              "mask": {"causal": "lower-right", "key_lengths": [9, 7]}},
     "`mask-backward-no-padding`", "a constant factor"),
    ("window_bwd_off_by_one", {"heads_q": 4, "heads_kv": 2, "n_k": 9,
                               "mask": {"causal": "lower-right", "window": [3, 0]}},
     "`mask-backward-window-left-1`", "a constant factor"),
    ("gqa_interleaved_fold", {"heads_q": 4, "heads_kv": 2}, "`gqa-backward-head-map`", "a constant factor"),
    ("dv_unnormalised", {"heads_q": 4, "heads_kv": 2, "mask": {"causal": "lower-right"}}, "`dv-unnormalised`",
     "a constant factor"),
    ("dq_from_scores_transposed", {"heads_q": 4, "heads_kv": 2, "mask": {"causal": "upper-left"}},
     "`dq-transposed-scores`", "a constant factor"),
    ("scale_ignored", {"heads_q": 2, "heads_kv": 2, "scale": 0.9}, "scales the scores by 1/sqrt(d_head)",
     "a constant factor"),
    ("softcap_slope_at_raw", {"heads_q": 4, "heads_kv": 2, "softcap": 1.5}, "`softcap-slope-raw-score`",
     "a constant factor"),
    ("lse_grad_no_weights", {"heads_q": 4, "heads_kv": 2, "n_k": 9, "outputs": ["o", "lse"],
                             "mask": {"causal": "lower-right"}}, "`lse-grad-no-weights`", "a constant factor"),
    ("dropout_dp_unmasked", {"heads_q": 4, "heads_kv": 2, "dropout": {"p": 0.2}}, "`dropout-dp-unmasked`",
     "a constant factor"),
    # from a fourth and a fifth cold trial
    ("lse_saved_half", {"heads_q": 4, "heads_kv": 2, "mask": {"causal": "lower-right"}},
     "`lse-saved-float16-rowsum-of-p`", "does not sum to 0"),
    ("backward_unscaled", {"heads_q": 4, "heads_kv": 2, "scale": 0.4}, "`backward-softmax-unscaled`",
     "does not sum to 0"),
    ("scale_divided", {"heads_q": 2, "heads_kv": 2, "scale": 0.4}, "scales the scores by 1/scale", "a constant factor"),
]


@pytest.mark.parametrize("obj, keys, said, unsaid", ATTENTION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ATTENTION_CASES)])
def test_attention_hints_name_the_cause_where_they_once_misled(obj, keys, said, unsaid):
    doc = {"scenarios": [{"name": obj, "batch": 2, "n_q": 6, "d_head": 4, **keys,
                          "implementation": f"attention_bugs:{obj}"}]}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=BUGS_DIR)[0])
    text = " | ".join(result.hints)
    if said is None:  # correct code
        assert result.verdict.value == "pass" and unsaid not in text, result.hints
        return
    assert result.verdict.value == "fail"
    assert said in text and unsaid not in text, result.hints


@pytest.mark.parametrize("keys, factor, said", [
    ({}, -1.0, "the sign of the score gradient is flipped"),
    ({"softcap": 1.5}, -1.0, "the sign of the score gradient is flipped"),
    ({"dropout": {"p": 0.2}}, 1.25, "it is 1/(1 - p) (p = 0.2)"),
    ({}, 1 / np.log(2), "exp2 domain"),
    ({"scale": 0.5}, 2.0, "it is 1/scale"),
    ({"softcap": 4.0}, 0.25, "it is 1/softcap"),
    ({}, 3.7, "one common factor on the score gradient"),
])
def test_a_common_factor_on_dq_and_dk_is_named_by_what_it_equals(keys, factor, said):
    """A fresh trial's misleading hints: every factor on G_Q and G_K was called the scale (-1, 1/(1 - p),
    log2(e) among them). Now the hint says what the factor is, and blames the scale only when it is the scale."""
    from gradcheck_cli.ops.attention.hints.patterns import _scale

    from helpers import make
    sc = make(heads_q=2, n_q=4, d_head=4, **keys)
    hint = _scale(sc, {"q": factor, "k": factor}, {"v": "pass"})
    assert said in hint, hint
    assert ("scale factor in the backward" in hint) == (said == "it is 1/scale"), hint


def test_what_a_dense_op_s_gradients_are_when_no_known_mistake_explains_them():
    """A factor (tensors sharing it said together), a swapped pair, a transposed square weight, a zero gradient;
    a single element is never 'a constant factor' (any two numbers are)."""
    rng = np.random.default_rng(0)
    a, b, w = rng.standard_normal((3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((5, 5))
    ev = {"a": _evidence(0.5 * a, a), "b": _evidence(0.5 * b, b)}
    assert fingerprints.patterns(ev, {"a", "b"}) == [
        "da, db are each 0.5 x the finite differences everywhere: a constant factor (a scale, temperature or "
        "normaliser applied once too often or too rarely, a wrong divisor, or a mean where a sum belongs)"]
    said = fingerprints.patterns({"a": _evidence(b, a), "b": _evidence(a, b)}, {"a", "b"})
    assert len(said) == 1 and "in each other's place" in said[0]
    said = fingerprints.patterns({"w": _evidence(w.T, w)}, {"w"})
    assert len(said) == 1 and "dw is transposed" in said[0]
    said = fingerprints.patterns({"a": _evidence(np.zeros_like(a), a)}, {"a"})
    assert len(said) == 1 and "gets no gradient at all" in said[0]
    assert fingerprints.patterns({"t": _evidence(np.array([2.0]), np.array([-3.0]))}, {"t"}) == []
    assert fingerprints.patterns({"a": _evidence(a + 1, a)}, {"a"}) == []  # no pattern: nothing said


def test_rope_failures_are_located_in_the_op_s_language():
    """Issue 26, item 2: a RoPE backward with one sign wrong in the second row of each pair is located by its
    feature classes (first vs second feature of each rotated pair) and by the features out of tolerance."""
    from gradcheck_cli.report.common import class_texts, where_text
    result = _run("dense_bugs", "RoPEOneSign", {"op": "rope", "batch": 2, "heads": 2, "n": 6, "d_head": 8})
    check = next(c for c in result.checks if c.name == "gradient x")
    d = check.diagnosis
    classes = {c["label"]: c["out_of_tolerance"] for c in d["classes"]}
    assert classes["first feature of each rotated pair"] == 0 < classes["second feature of each rotated pair"]
    assert "feature 4-7 of 8" in where_text(d), where_text(d)
    assert any(line.startswith("second feature of each rotated pair") for line in class_texts(d))
    # a norm's gamma that is wrong everywhere names no feature range (the whole axis is not news)
    result = _run("dense_bugs", "RMSNormDgammaMean", {"op": "rmsnorm", "batch": 2, "n": 5, "d_model": 16})
    d = next(c for c in result.checks if c.name == "gradient gamma").diagnosis
    assert where_text(d) == "where: 16 of 16 checked elements out of tolerance", where_text(d)


#: A scenario per op on which its known mistakes apply (square SwiGLU weights, an eps no mistake hard-codes, in-batch
#: InfoNCE with hard negatives and a learned temperature, RoPE at an offset).
INJECTED = {"rmsnorm": {"batch": 2, "n": 3, "d_model": 8, "eps": 0.01},
            "layernorm": {"batch": 2, "n": 3, "d_model": 8, "eps": 0.01},
            "swiglu": {"batch": 2, "n": 3, "d_model": 6, "d_ff": 6},
            "rope": {"batch": 2, "heads": 2, "n": 4, "d_head": 8, "rotary_dim": 6, "position_offset": 3},
            "infonce": {"batch": 3, "dim": 4, "hard_negatives": 2, "learn_temperature": True, "temperature": 0.5}}
#: Mistakes that need their own shapes: every query with as many candidates as there are queries.
SQUARE = {"infonce-candidates-untransposed": {"hard_negatives": 0},
          "infonce-upstream-along-candidates": {"hard_negatives": 0}, "infonce-dq-untransposed": {"hard_negatives": 0}}
#: Known mistakes the injected implementation cannot show: written into the user engine's own backward (RoPE's table
#: rebuilt from position 0), or for cosine similarity (InfoNCE's projection) while the injected InfoNCE is dot.
NOT_INJECTED = {"rope-backward-positions-from-zero", "infonce-cosine-no-projection",
                "infonce-candidates-no-normalisation", "infonce-queries-no-normalisation"}


def _injected(op: str) -> list[tuple[str, str, bool]]:
    from gradcheck_cli.ops import OPS
    from gradcheck_cli.ops.infonce import MISTAKES as NCE
    mistakes = NCE if op == "infonce" else __import__(f"gradcheck_cli.ops.{op}", fromlist=["MISTAKES"]).MISTAKES
    forward = getattr(__import__(f"gradcheck_cli.ops.{op}", fromlist=["x"]), "FORWARD_MISTAKES", {})
    del OPS
    return ([(op, m, False) for m in mistakes if m not in NOT_INJECTED]
            + [(op, m, True) for m in forward if op in ("rmsnorm", "layernorm", "swiglu")])


@pytest.mark.parametrize("op", sorted(INJECTED))
def test_every_known_mistake_injected_into_the_op_s_own_code_is_named_by_its_own_name(op):
    """Issue 26's table test over every known mistake of the dense ops: the op's own forward and backward with one
    mistake put in (tests/bugs/injected.py), run as a user's NumPy code. Each that fails is named by its own name (or
    together with mistakes that give the same gradients here), and each is shown to fail at least once; the same code
    without a mistake passes with no cause named."""
    def run(obj, mistake=""):
        keys = {**INJECTED[op], **SQUARE.get(mistake, {})}
        doc = {"scenarios": [{"name": "injected", "op": op, **keys, "implementation": f"injected:{obj}"}]}
        return checker.run_scenario(scenario.loads(yaml.safe_dump(doc), base_dir=BUGS_DIR)[0])

    clean = run(f"{op}__none")
    assert clean.verdict.value == "pass" and not _named(clean.hints), clean.hints
    for _, mistake, forward in _injected(op):
        obj = f"{op}__{'forward__' if forward else ''}{mistake.replace('-', '_').replace('.', '_p_')}"
        result = run(obj, mistake)
        assert result.verdict.value == "fail", (obj, [c.name for c in result.checks if c.verdict == "fail"])
        assert mistake in _named(result.hints), (obj, result.hints)
