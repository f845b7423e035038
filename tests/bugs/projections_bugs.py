"""Hand-written multi-head self-attention layers (Q = x W_Q, K = x W_K, V = x W_V, GQA by kv_map, O W_O) with their
backward, and the mistakes their authors make; see dense_bugs.py. forward(x, w_q, w_k, w_v, w_o, visible, scale,
kv_map) -> y, backward(..., grad_y) -> (dx, dw_q, dw_k, dw_v, dw_o)."""
import numpy as np


def _heads(t, h):
    b, n, _ = t.shape
    return t.reshape(b, n, h, -1).transpose(0, 2, 1, 3)


def _merge(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


class Layer:
    """Correct."""

    def parts(self, x, w_q, w_k, w_v, visible, scale, kv_map):
        hq, hkv = len(kv_map), int(np.max(kv_map)) + 1
        q, k, v = _heads(x @ w_q, hq), _heads(x @ w_k, hkv)[:, kv_map], _heads(x @ w_v, hkv)[:, kv_map]
        s = np.where(visible, scale * q @ np.swapaxes(k, -1, -2), -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        return q, k, v, a / a.sum(-1, keepdims=True)

    def forward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map):
        q, k, v, a = self.parts(x, w_q, w_k, w_v, visible, scale, kv_map)
        return _merge(a @ v) @ w_o

    def fold(self, g, kv_map):
        """[B, Hq, n, d] -> [B, Hkv, n, d]: the query heads' shares summed into their KV head."""
        out = np.zeros((g.shape[0], int(np.max(kv_map)) + 1) + g.shape[2:])
        np.add.at(out, (slice(None), kv_map), g)
        return out

    def input_grad(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T + dk @ w_k.T + dv @ w_v.T

    def weight_grad(self, x, g):
        return x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])

    def backward(self, x, w_q, w_k, w_v, w_o, visible, scale, kv_map, grad_y):
        q, k, v, a = self.parts(x, w_q, w_k, w_v, visible, scale, kv_map)
        o = _merge(a @ v)
        g_o = _heads(grad_y @ w_o.T, len(kv_map))
        g_a = g_o @ np.swapaxes(v, -1, -2)
        g_s = a * (g_a - (g_a * a).sum(-1, keepdims=True))
        dq = _merge(scale * g_s @ k)
        dk = _merge(self.fold(scale * np.swapaxes(g_s, -1, -2) @ q, kv_map))
        dv = _merge(self.fold(np.swapaxes(a, -1, -2) @ g_o, kv_map))
        return (self.input_grad(dq, dk, dv, w_q, w_k, w_v), self.weight_grad(x, dq), self.weight_grad(x, dk),
                self.weight_grad(x, dv), self.weight_grad(o, grad_y))


class LayerXFromQueriesOnly(Layer):
    def input_grad(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T  # written for cross-attention, reused for self-attention


class LayerNoValuePath(Layer):
    def input_grad(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T + dk @ w_k.T


class LayerNoKeyPath(Layer):
    def input_grad(self, dq, dk, dv, w_q, w_k, w_v):
        return dq @ w_q.T + dv @ w_v.T


class LayerWeightsAveraged(Layer):
    def weight_grad(self, x, g):
        rows = x.reshape(-1, x.shape[-1])
        return rows.T @ g.reshape(-1, g.shape[-1]) / rows.shape[0]  # a mean-reduced loss habit


class LayerGqaOverwrite(Layer):
    def fold(self, g, kv_map):
        out = np.zeros((g.shape[0], int(np.max(kv_map)) + 1) + g.shape[2:])
        for h, group in enumerate(kv_map):
            out[:, group] = g[:, h]  # = where += belongs: the group's last query head wins
        return out


LAYER = {"op": "attention-projections", "batch": 2, "d_model": 12, "d_head": 4, "n_q": 6, "heads_q": 4,
         "heads_kv": 2, "mask": {"causal": "lower-right"}}

BUGS = [
    ("Layer", None, LAYER),
    ("LayerXFromQueriesOnly", "shared-input-sum", LAYER),
    ("LayerNoValuePath", "projections-no-v-path", LAYER),
    ("LayerNoKeyPath", "projections-no-k-path", LAYER),
    ("LayerWeightsAveraged", "projections-dw-mean", LAYER),
    ("LayerGqaOverwrite", "gqa-sum", LAYER),
]

for _name, _value in list(globals().items()):
    if isinstance(_value, type) and hasattr(_value, "backward"):
        globals()[_name + "_"] = _value()
