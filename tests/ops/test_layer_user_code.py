"""User code for attention-projections and block (the shared user engine): a correct layer passes in every
flavour with every weight's gradient checked, the mask invariants run on it, a detached residual fails
gradient x alone, and every fault of the parts is detected on it."""
import numpy as np
import pytest
import yaml

from gradcheck_cli import checker, scenario

from helpers import with_examples

PROJECTIONS = dict(op="attention-projections", batch=2, heads_q=4, heads_kv=2, n_q=5, d_head=3, d_model=8,
                   mask={"causal": "lower-right"})
BLOCK = dict(op="block", batch=2, heads_q=2, heads_kv=1, n_q=4, d_head=4, d_model=8, d_ff=12,
             mask={"causal": "lower-right"})


def _passes(sc):
    result = checker.run_scenario(sc)
    assert result.verdict == "pass", [(c.name, c.tensor, c.detail) for c in result.checks if not c.passed]
    return result


# The JAX cases are slow: they are examples/jax_ops.yaml's jax-attention-projections and jax-block, key for key,
# which tests/ops/test_jax_flavour.py runs by default (JAX compiles for every shape: seconds each).
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
@pytest.mark.parametrize("keys, attr, tensors", [
    (PROJECTIONS, "attention_projections", {"x", "w_q", "w_k", "w_v", "w_o"}),
    (BLOCK, "block", {"x", "gamma1", "w_q", "w_k", "w_v", "w_o", "gamma2", "w1", "w3", "w2"})])
def test_a_correct_layer_passes_with_every_weight_and_the_mask_invariants(backend, keys, attr, tensors):
    pytest.importorskip(backend)
    module = "torch_ops" if backend == "torch" else "jax_ops"
    result = _passes(with_examples(**keys, backend=backend, implementation=f"{module}:{attr}"))
    assert {c.tensor for c in result.checks if c.name.startswith("gradient ")} == tensors
    assert {"hidden x rows do not change y", "unseen x rows get zero gradient"} <= {c.name for c in result.checks}


def test_cross_attention_checks_the_memory_too():
    pytest.importorskip("torch")
    result = _passes(with_examples(op="attention-projections", source="cross", batch=2, heads_q=2, n_q=3, n_k=5,
                                   d_head=4, d_model=8, mask={"key_lengths": [5, 2]}, backend="torch",
                                   implementation="torch_ops:cross_attention"))
    assert "m" in {c.tensor for c in result.checks if c.name == "gradient m"}
    assert any(c.name == "unseen m rows get zero gradient" for c in result.checks)


def test_a_detached_residual_fails_gradient_x_and_nothing_else():
    pytest.importorskip("torch")
    result = checker.run_scenario(with_examples(**BLOCK, backend="torch",
                                                implementation="torch_ops:block_detached_residual"))
    failed = {(c.name, c.tensor) for c in result.checks if not c.passed}
    assert failed == {("gradient x", "x"), ("backward agrees with the reference", "x")}, failed


def test_every_fault_of_the_parts_is_detected_on_a_user_block():
    pytest.importorskip("torch")
    cells = checker.negative_controls([with_examples(**BLOCK, backend="torch", implementation="torch_ops:block")])
    assert {c.status for c in cells} == {"detected"} and len(cells) >= 10
    mask = next(c for c in cells if c.fault == "mask")  # shown every key as visible: the forward disagrees
    assert "forward agrees with the reference" in mask.caught_by


class NumpyProjections:
    """A NumPy forward and backward (the numpy flavour), computed by hand with the head split explicit."""

    @staticmethod
    def _heads(t, h):
        return np.swapaxes(t.reshape(t.shape[:-1] + (h, -1)), 1, 2)

    def _parts(self, x, w_q, w_k, w_v, visible, scale, kv_map):
        h = visible.shape[1]
        hkv = w_k.shape[1] * h // w_q.shape[1]
        q, k, v = self._heads(x @ w_q, h), self._heads(x @ w_k, hkv)[:, kv_map], self._heads(x @ w_v, hkv)[:, kv_map]
        s = np.where(visible, scale * q @ np.swapaxes(k, -1, -2), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        return q, k, v, a / a.sum(-1, keepdims=True), hkv

    def forward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
        _, _, v, a, _ = self._parts(x, w_q, w_k, w_v, visible, scale, kv_map)
        o = np.swapaxes(a @ v, 1, 2)
        return o.reshape(o.shape[:2] + (-1,)) @ w_o

    def backward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map, grad_y):
        q, k, v, a, hkv = self._parts(x, w_q, w_k, w_v, visible, scale, kv_map)
        o = np.swapaxes(a @ v, 1, 2)
        merged = o.reshape(o.shape[:2] + (-1,))
        g_o = self._heads(grad_y @ w_o.T, q.shape[1])
        g_a = g_o @ np.swapaxes(v, -1, -2)
        g_s = a * (g_a - (g_a * a).sum(-1, keepdims=True))
        g_q, g_k, g_v = scale * g_s @ k, scale * np.swapaxes(g_s, -1, -2) @ q, np.swapaxes(a, -1, -2) @ g_o

        def merge(t, heads):  # sum the query heads sharing a KV head, then [B, H, n, d] -> [B, n, H*d]
            if heads != t.shape[1]:
                t = np.stack([t[:, kv_map == j].sum(1) for j in range(heads)], 1)
            t = np.swapaxes(t, 1, 2)
            return t.reshape(t.shape[:2] + (-1,))
        gq, gk, gv = merge(g_q, q.shape[1]), merge(g_k, hkv), merge(g_v, hkv)
        rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return (gq @ w_q.T + gk @ w_k.T + gv @ w_v.T, rows(x).T @ rows(gq), rows(x).T @ rows(gk),
                rows(x).T @ rows(gv), rows(merged).T @ rows(grad_y))


def test_the_numpy_flavour_checks_a_hand_written_layer(tmp_path):
    (tmp_path / "np_layer.py").write_text("import sys\n"
                                          "layer = sys.modules['test_layer_user_code'].NumpyProjections()\n")
    doc = {"scenarios": [{"name": "np", **PROJECTIONS, "implementation": "np_layer:layer"}]}
    _passes(scenario.loads(yaml.safe_dump(doc), base_dir=tmp_path)[0])


def test_a_layer_that_maps_kv_heads_interleaved_is_told_to_set_kv_map():
    pytest.importorskip("torch")
    keys = dict(PROJECTIONS, backend="torch", implementation="torch_ops:attention_projections_interleaved")
    result = checker.run_scenario(with_examples(**keys))
    assert "forward agrees with the reference" in {c.name for c in result.checks if not c.passed}
    assert any("set kv_map: interleaved" in h for h in result.hints), result.hints
    _passes(with_examples(**keys, kv_map="interleaved"))
    assert not checker.run_scenario(with_examples(**dict(PROJECTIONS, backend="torch",
                                                         implementation="torch_ops:attention_projections"))).hints
