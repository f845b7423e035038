"""Attention with its projections (ops/projections.py): the backward against a loop forward differentiated
by the complex step, self- and cross-attention."""
import numpy as np
import pytest

from gradcheck_cli.ops import OPS

from helpers import assert_close, make
from reference import complex_step_gradients, projections_ref


@pytest.mark.parametrize("source", ["self", "cross"])
def test_projections_backward_against_complex_step(source):
    keys = dict(op="attention-projections", batch=2, n_q=3, d_model=4, d_head=2, heads_q=2, heads_kv=1,
                mask={"causal": "lower-right"}, source=source)
    if source == "cross":
        keys.update(n_k=4, d_value=3, mask={"key_lengths": [4, 2]})
    sc = make(**keys)
    p = OPS["attention-projections"].problem(sc)
    kv = np.asarray(sc.kv_map)
    ref = complex_step_gradients(
        lambda x, w_q, w_k, w_v, w_o, m=None: projections_ref(x, w_q, w_k, w_v, w_o, sc.visible, sc.scale, kv, 2, 1, m),
        p.inputs, p.arrays["grad_output"])
    assert_close(p.gradients, ref)
