"""InfoNCE (ops/infonce/): the backward against a loop forward differentiated by the complex step, for
each similarity, negative source and a learned temperature; a user's implementation (examples/my_infonce.py)
checked with its black-box invariants, and the interface's argument order."""
import numpy as np
import pytest
import yaml

from gradcheck_cli import scenario
from gradcheck_cli.ops import OPS, infonce

from helpers import assert_close, make, with_examples
from reference import complex_step_gradients, infonce_ref


@pytest.mark.parametrize("similarity, in_batch, hard, learn", [("dot", True, 0, False), ("cosine", True, 2, True),
                                                               ("dot", False, 2, True), ("cosine", False, 1, False)])
def test_infonce_backward_against_complex_step(similarity, in_batch, hard, learn):
    sc = make(op="infonce", batch=3, dim=4, similarity=similarity, in_batch=in_batch, hard_negatives=hard,
              learn_temperature=learn, temperature=0.5)
    p = OPS["infonce"].problem(sc)

    def f(q, p, n=None, tau=None):
        return infonce_ref(q, p, n, 0.5 if tau is None else tau, similarity, in_batch)
    assert_close(p.gradients, complex_step_gradients(f, p.inputs, p.arrays["grad_output"]))
    assert np.allclose(p.output,
                       infonce_ref(p.inputs["q"], p.inputs["p"], p.inputs.get("n"), 0.5, similarity, in_batch))


def _user(spec: str, **keys):
    return with_examples(op="infonce", batch=4, dim=8, implementation=spec, **keys)


USER_CASES = [  # (implementation, scenario keys): every similarity, negative source and tau
    ("my_infonce:infonce", dict(hard_negatives=2)),
    ("my_infonce:infonce", dict(learn_temperature=True, temperature=0.5)),
    ("my_infonce:infonce_cosine", dict(hard_negatives=1, similarity="cosine", learn_temperature=True)),
    ("my_infonce:infonce_own", dict(hard_negatives=3, in_batch=False, learn_temperature=True)),
    ("my_infonce:infonce", dict(hard_negatives=1, dtype="float32")),
]


@pytest.mark.parametrize("spec, keys", USER_CASES, ids=[str(sorted(k.items())) for _, k in USER_CASES])
def test_a_correct_user_infonce_passes_and_its_fault_is_caught_on_it(spec, keys):
    from gradcheck_cli import checker
    sc = _user(spec, **keys)
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]
    names = {(c.name, c.tensor) for c in result.checks}
    assert ("gradient tau", "tau") in names if keys.get("learn_temperature") else all(t != "tau" for _, t in names)
    assert (("gradient n", "n") in names) == bool(keys.get("hard_negatives"))
    invariant = "<G_x, x> = 0 per vector (cosine)" if keys.get("similarity") == "cosine" else infonce.CANDIDATES_SUM
    assert invariant in {name for name, _ in names}
    assert {c.status for c in checker.negative_controls([sc])} == {"detected"}


@pytest.mark.parametrize("spec, keys", [("my_infonce:missing_normaliser", dict(hard_negatives=2)),
                                        ("my_infonce:missing_normaliser_own", dict(hard_negatives=2, in_batch=False))])
def test_a_user_infonce_without_the_softmax_denominator_gradient_fails_where_it_is_wrong(spec, keys):
    from gradcheck_cli import checker
    failed = {(c.name, c.tensor) for c in checker.run_scenario(_user(spec, **keys)).checks if not c.passed}
    wrong = {(check, t) for t in "qpn" for check in (f"gradient {t}", "backward agrees with the reference")}
    assert failed == wrong | {
        (infonce.CANDIDATES_SUM, "g_candidates")}, failed


SPY = """
import numpy as np
from gradcheck_cli.ops import infonce
seen = []

class Spy:
    @staticmethod
    def forward(q, p, n, tau):
        seen.append((q.shape, n.shape, np.shape(tau)))
        return infonce.forward(q, p, None, tau, "dot", True)

    @staticmethod
    def backward(q, p, n, tau, grad_l):
        grads = infonce.backward(q, p, None, tau, grad_l, "dot", True)
        return grads["q"], grads["p"], None, grads["tau"]  # dn: not checked without hard negatives

spy = Spy()

class Three(Spy):
    @staticmethod
    def backward(q, p, n, tau, grad_l):
        return Spy.backward(q, p, n, tau, grad_l)[:3]

three = Three()
"""


def _spy(tmp_path, attr: str, **keys):
    (tmp_path / "infonce_spy.py").write_text(SPY)
    doc = {"scenarios": [{"name": "t", "op": "infonce", "batch": 4, "dim": 8, "implementation": f"infonce_spy:{attr}",
                          **keys}]}
    return scenario.loads(yaml.safe_dump(doc), base_dir=tmp_path)[0]


def test_a_user_infonce_gets_q_p_n_tau_always_and_tau_is_differentiated_only_when_learned(tmp_path):
    """Without hard negatives n is [B, 0, dim]; a learned tau is differentiated (the engine's inputs come
    first, the interface still passes tau last) and its gradient checked; a fixed one is not."""
    import sys

    from gradcheck_cli import checker
    for learn in (True, False):
        result = checker.run_scenario(_spy(tmp_path, "spy", learn_temperature=learn, temperature=0.5))
        assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
        assert ("gradient tau" in {c.name for c in result.checks}) == learn
    seen = sys.modules["infonce_spy"].seen
    assert {(n, tau) for _, n, tau in seen} == {((4, 0, 8), ())}, seen
    assert {q[0] for q, _, _ in seen} == {4}  # in-batch negatives: copies are never stacked along the batch


def test_a_user_infonce_backward_of_the_wrong_arity_is_a_failed_check(tmp_path):
    from gradcheck_cli import checker
    [check] = checker.run_scenario(_spy(tmp_path, "three")).checks
    assert (check.name, check.passed) == ("implementation runs", False)
    assert "backward must return (dq, dp, dn, dtau), got tuple of 3" in check.detail, check.detail


def test_a_saturated_softmax_keeps_its_tiny_loss_and_passes():
    """The positive dominates by ~40 logits: l = log(1 + e^-40) ~ 4e-18, which lse - z_pos cancels to 0 in any
    precision (then finite differences see a flat loss while the gradient is ~1e-16: a false FAIL, found by the
    plain grid, seed 93). The forward forms it as log1p of the others' exp(z_c - z_pos): it stays accurate."""
    from gradcheck_cli import checker
    from gradcheck_cli.ops.infonce.formulas import forward
    sc = make(op="infonce", dtype="float32", seed=710339560, batch=2, dim=2, hard_negatives=1, in_batch=False,
              similarity="cosine", temperature=0.0299, learn_temperature=False)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    q, p, n = np.array([[1.0, 0.0]]), np.array([[1.0, 0.0]]), np.array([[[0.0, 1.0]]])
    l = forward(q, p, n, 0.025, "cosine", False)  # z = [40, 0]
    np.testing.assert_allclose(l, np.log1p(np.exp(-40.0)), rtol=1e-12)
