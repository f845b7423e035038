"""An independent float64 reference, written differently from the engine on purpose: plain loops over
(batch, head, row), the softmax Jacobian built explicitly per row, and GQA by explicit accumulation.
Only for tests: small shapes."""
from __future__ import annotations

import numpy as np


def attention_loops(q, k, v, visible, scale, kv_map, grad_o):
    """Returns (o, g_q, g_k, g_v) for q [B,Hq,n_q,d], k [B,Hkv,n_k,d], v [B,Hkv,n_k,dv]."""
    q, k, v, grad_o = (np.asarray(x, dtype=np.float64) for x in (q, k, v, grad_o))
    B, Hq, n_q, _ = q.shape
    o = np.zeros(grad_o.shape)
    g_q, g_k, g_v = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for b in range(B):
        for r in range(Hq):
            g = kv_map[r]
            for i in range(n_q):
                cols = np.flatnonzero(visible[b, r, i])
                logits = np.array([scale * np.dot(q[b, r, i], k[b, g, j]) for j in cols])
                p = np.exp(logits - logits.max())
                p /= p.sum()
                o[b, r, i] = sum(p_j * v[b, g, j] for p_j, j in zip(p, cols))
                # dL/dp_j = <grad_o_i, v_j>; dL/dlogits = J^T dL/dp with J = diag(p) - p p^T
                dp = np.array([np.dot(grad_o[b, r, i], v[b, g, j]) for j in cols])
                jac = np.diag(p) - np.outer(p, p)
                dlogits = jac.T @ dp
                for t, j in enumerate(cols):
                    g_v[b, g, j] += p[t] * grad_o[b, r, i]
                    g_q[b, r, i] += scale * dlogits[t] * k[b, g, j]
                    g_k[b, g, j] += scale * dlogits[t] * q[b, r, i]
    return o, g_q, g_k, g_v


def visible_loops(batch, heads_q, n_q, n_k, causal="none", window=None, key_lengths=None):
    """The visible set from the rules in docs/scenarios.md "Masks", one element at a time."""
    out = np.zeros((batch, heads_q, n_q, n_k), dtype=bool)
    for b in range(batch):
        for h in range(heads_q):
            for i in range(n_q):
                diag = i if causal == "upper-left" else i + n_k - n_q
                for j in range(n_k):
                    ok = True
                    if causal != "none" and j > diag:
                        ok = False
                    if window is not None:
                        left, right = window
                        if left is not None and j < diag - left:
                            ok = False
                        if right is not None and j > diag + right:
                            ok = False
                    if key_lengths is not None and j >= key_lengths[b]:
                        ok = False
                    out[b, h, i, j] = ok
    return out


# --- Independent forwards for the other ops (loops, written apart from gradcheck_cli/ops), and
# complex-step derivatives: d/dx_i f = Im f(x + i h e_i) / h is exact to rounding for analytic f,
# with no subtraction, so it is a gradient independent of both the backward and finite differences.

def rmsnorm_ref(x, gamma, eps):
    out = np.zeros_like(x)
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        r = (sum(c * c for c in row) / len(row) + eps) ** 0.5
        out[idx] = [gamma[c] * row[c] / r for c in range(len(row))]
    return out


def rope_ref(x, base, rotary_dim, layout, offset):
    out = x.copy()
    n = x.shape[-2]
    for idx in np.ndindex(*x.shape[:-2]):
        for i in range(n):
            for k in range(rotary_dim // 2):
                angle = (offset + i) * base ** (-2.0 * k / rotary_dim)
                a_i, b_i = (k, k + rotary_dim // 2) if layout == "half" else (2 * k, 2 * k + 1)
                a, b = x[idx + (i, a_i)], x[idx + (i, b_i)]
                out[idx + (i, a_i)] = a * np.cos(angle) - b * np.sin(angle)
                out[idx + (i, b_i)] = a * np.sin(angle) + b * np.cos(angle)
    return out


def swiglu_ref(x, w1, w3, w2):
    a = np.einsum("bnd,df->bnf", x, w1)
    b = np.einsum("bnd,df->bnf", x, w3)
    h = a / (1 + np.exp(-a)) * b
    return np.einsum("bnf,fd->bnd", h, w2)


def complex_step_gradients(f, inputs: dict, g, h: float = 1e-30) -> dict:
    """dL/d(input) of L = sum(f(**inputs) * g), element by element by the complex step."""
    out = {}
    for name, x in inputs.items():
        grad = np.zeros(x.shape)
        for idx in np.ndindex(*x.shape):
            args = {k: v.astype(np.complex128) for k, v in inputs.items()}
            args[name][idx] += 1j * h
            grad[idx] = np.sum(f(**args) * g).imag / h
        out[name] = grad
    return out


def attention_ref(q, k, v, visible, scale, kv_map):
    """Masked softmax attention by einsum, no max-subtraction (complex-step friendly; small inputs)."""
    k_rep, v_rep = k[:, list(kv_map)], v[:, list(kv_map)]
    e = np.exp(scale * np.einsum("bhid,bhjd->bhij", q, k_rep)) * visible
    return np.einsum("bhij,bhjd->bhid", e / e.sum(-1, keepdims=True), v_rep)


def heads(t, h):
    b, n, hd = t.shape
    return t.reshape(b, n, h, hd // h).transpose(0, 2, 1, 3)


def unheads(t):
    b, h, n, d = t.shape
    return t.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def projections_ref(x, w_q, w_k, w_v, w_o, visible, scale, kv_map, hq, hkv, m=None):
    s = x if m is None else m
    o = attention_ref(heads(x @ w_q, hq), heads(s @ w_k, hkv), heads(s @ w_v, hkv), visible, scale, kv_map)
    return unheads(o) @ w_o


def infonce_ref(q, p, n, tau, similarity, in_batch):
    """Per-query loss by loops over queries and candidates."""
    out = []
    for i in range(q.shape[0]):
        if in_batch:
            cands = list(p) + ([c for row in n for c in row] if n is not None else [])
            pos = i
        else:
            cands = [p[i]] + (list(n[i]) if n is not None else [])
            pos = 0
        def sim(a, b):
            if similarity == "cosine":
                return np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b))
            return np.dot(a, b)
        z = [sim(q[i], c) / tau for c in cands]
        out.append(np.log(sum(np.exp(t) for t in z)) - z[pos])
    return np.array(out)
