"""InfoNCE (ops/infonce.py): the backward against a loop forward differentiated by the complex step, for
each similarity, negative source and a learned temperature."""
import numpy as np
import pytest

from gradcheck_cli.ops import OPS

from helpers import assert_close, make
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
