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
    """The visible set from the rules in the README, one element at a time."""
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
