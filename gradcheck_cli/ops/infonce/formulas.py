"""InfoNCE's closed forms: the candidates, similarities, forward, backward (the derivation is the package's
docstring) and the size of the terms of each result."""
from __future__ import annotations

from collections.abc import Collection

import numpy as np


def _unit(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True))


def _candidates(p, n, in_batch: bool):
    """in_batch: C [..., B + B*k, dim] shared by all queries; else C [..., B, 1 + k, dim] per query."""
    if n is None:
        return p if in_batch else p[..., :, None, :]
    if in_batch:
        lead = np.broadcast_shapes(p.shape[:-2], n.shape[:-3])
        flat = n.reshape(n.shape[:-3] + (-1, n.shape[-1]))
        return np.concatenate([np.broadcast_to(p, lead + p.shape[-2:]),
                               np.broadcast_to(flat, lead + flat.shape[-2:])], axis=-2)
    lead = np.broadcast_shapes(p.shape[:-2], n.shape[:-3])
    return np.concatenate([np.broadcast_to(p[..., :, None, :], lead + p.shape[-2:-1] + (1, p.shape[-1])),
                           np.broadcast_to(n, lead + n.shape[-3:])], axis=-2)


def similarities(q, p, n, similarity: str, in_batch: bool):
    """s [..., B, candidates]."""
    c = _candidates(p, n, in_batch)
    if similarity == "cosine":
        q, c = _unit(q), _unit(c)
    if in_batch:
        return q @ np.swapaxes(c, -1, -2)
    return np.einsum("...bd,...bcd->...bc", q, c)


def positives(batch: int, in_batch: bool) -> np.ndarray:
    return np.arange(batch) if in_batch else np.zeros(batch, dtype=np.intp)


def forward(q, p, n, tau, similarity: str, in_batch: bool):
    """l [..., B]: log-sum-exp of the logits minus the positive's logit, formed as log sum_c exp(z_c - z_pos) =
    m + log1p(sum of the other exp(d_c - m)) with d = z - z_pos and m = max d: when the positive dominates, l is
    about exp(-gap), far below the rounding of lse and z_pos, and lse - z_pos would cancel it to 0 in any
    precision (its finite differences then see a flat loss where the gradient is not 0)."""
    z = similarities(q, p, n, similarity, in_batch) / tau
    batch = q.shape[-2]
    d = z - z[..., np.arange(batch), positives(batch, in_batch)][..., None]
    m = d.max(axis=-1, keepdims=True)
    e = np.exp(d - m)
    np.put_along_axis(e, np.argmax(d, axis=-1)[..., None], 0.0, axis=-1)  # the largest term is exp(0) = 1
    return m[..., 0] + np.log1p(e.sum(axis=-1))


def backward(q, p, n, tau, grad_l, similarity: str, in_batch: bool, faults: Collection[str] = ()) -> dict:
    """Gradients of L = sum(l * grad_l): q, p, n (when given), tau, and the logit gradient z."""
    s = similarities(q, p, n, similarity, in_batch)
    z = s / tau
    axis = 0 if "infonce-softmax-axis" in faults else -1
    a = np.exp(z - z.max(axis=axis, keepdims=True))
    a /= a.sum(axis=axis, keepdims=True)
    onehot = np.zeros_like(z)
    onehot[np.arange(q.shape[0]), positives(q.shape[0], in_batch)] = 1.0
    upstream = np.ones_like(grad_l) if "infonce-upstream-ignored" in faults else grad_l
    if "infonce-upstream-along-candidates" in faults:
        if z.shape[-1] != z.shape[-2]:
            raise ValueError("as many candidates as queries needed")
        g_z = upstream[None, :] * (a - onehot)
    else:
        g_z = upstream[:, None] * ((0.0 if "infonce-normaliser" in faults else a) - onehot)
    g_s = g_z if "infonce-tau-once" in faults else (g_z * tau if "infonce-tau-times" in faults else g_z / tau)
    c = _candidates(p, n, in_batch)
    uq, uc = (_unit(q), _unit(c)) if similarity == "cosine" else (q, c)
    if in_batch:
        g_uq = (g_s.T if "infonce-dq-untransposed" in faults else g_s) @ uc
        g_uc = (g_s if "infonce-candidates-untransposed" in faults else g_s.T) @ uq
    else:
        g_uq, g_uc = np.einsum("bc,bcd->bd", g_s, uc), g_s[..., None] * uq[:, None, :]
    if similarity == "cosine":
        keep = 0.0 if "infonce-cosine-no-projection" in faults else 1.0  # the mistake: d(x/|x|) taken as 1/|x|
        g_q = (g_uq - keep * uq * np.sum(uq * g_uq, axis=-1, keepdims=True)) / np.linalg.norm(q, axis=-1,
                                                                                               keepdims=True)
        g_c = (g_uc - keep * uc * np.sum(uc * g_uc, axis=-1, keepdims=True)) / np.linalg.norm(c, axis=-1,
                                                                                               keepdims=True)
        g_q = g_uq if "infonce-queries-no-normalisation" in faults else g_q
        g_c = g_uc if "infonce-candidates-no-normalisation" in faults else g_c
    else:
        g_q, g_c = g_uq, g_uc
    batch = q.shape[0]
    out = {"q": g_q}
    if in_batch:
        out["p"] = g_c[:batch]
        if "infonce-positive-own-query-only" in faults:
            if similarity == "cosine":
                raise ValueError("the own-query mistake is written for dot similarity")
            out["p"] = np.diagonal(g_s[..., :batch], axis1=-2, axis2=-1)[..., None] * q
        if n is not None:
            out["n"] = g_c[batch:].reshape(n.shape) if "infonce-negatives-order" not in faults else np.swapaxes(
                g_c[batch:].reshape(n.shape[1], n.shape[0], n.shape[2]), 0, 1)
    else:
        out["p"] = g_c[:, 0]
        if n is not None:
            out["n"] = g_c[:, 1:]
    g_zt = (a - onehot) if "infonce-dtau-no-upstream" in faults else g_z
    out["tau"] = np.asarray((1.0 if "infonce-dtau-sign" in faults else -1.0) * np.sum(g_zt * s)
                            / (tau if "infonce-dtau-one-tau" in faults else (
                                tau**3 if "infonce-dtau-tau-cubed" in faults else tau**2)),
                            dtype=q.dtype)
    out["z"] = g_z
    return out


def _split_candidates(t: np.ndarray, batch: int, n_shape, in_batch: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """A candidate-shaped array (``_candidates``'s layout) as its positives' and hard negatives' parts."""
    if in_batch:
        return t[:batch], (t[batch:].reshape(n_shape) if n_shape is not None else None)
    return t[:, 0], (t[:, 1:] if n_shape is not None else None)


def _terms(q, p, n, tau, grad_l, similarity: str, in_batch: bool) -> dict[str, np.ndarray]:
    """The size of the terms of l and of each gradient (float64), rounding being about eps x these. Every
    product and sum is taken on absolute values; the logits z = s / tau carry their own terms T_z, the
    softmax weights a relative eps (1 + |z - max z| + T_z), and l = lse - z[positive] is charged its
    parts (|max z|, |z[positive]|), never its value (it cancels when the positive dominates)."""
    q, p, tau, gl = (np.asarray(t, dtype=np.float64) for t in (q, p, tau, grad_l))
    n = None if n is None else np.asarray(n, dtype=np.float64)
    batch = q.shape[0]
    c = _candidates(p, n, in_batch)
    cosine = similarity == "cosine"
    uq, uc = (_unit(q), _unit(c)) if cosine else (q, c)
    aq, ac = np.abs(uq), np.abs(uc)

    def pair(a, b):  # [B, candidates]: sum over features of a_i b_c
        return a @ b.T if in_batch else np.einsum("bd,bcd->bc", a, b)

    s = similarities(q, p, n, similarity, in_batch)
    abs_tau = abs(float(tau))
    z = s / float(tau)
    t_z = (3.0 if cosine else 1.0) * pair(aq, ac) / abs_tau + np.abs(z)  # the normalisations' rounding too
    spread = z.max(axis=-1, keepdims=True) - z
    a = np.exp(-spread)
    a /= a.sum(axis=-1, keepdims=True)
    rows = np.arange(batch)
    onehot = np.zeros_like(z)
    onehot[rows, positives(batch, in_batch)] = 1.0
    t_o = (2.0 * (np.abs(z).max(axis=-1) + t_z.max(axis=-1) + np.sum(a * (1.0 + spread), axis=-1))
           + np.log(z.shape[-1]) + np.abs(z[rows, positives(batch, in_batch)]))
    g_abs = np.abs(gl)[:, None]
    g_z = g_abs * (a + onehot)
    t_gz = g_abs * (a * (2.0 + spread + t_z + np.sum(a * t_z, axis=-1, keepdims=True)) + onehot)
    t_gs = (t_gz + g_z) / abs_tau
    if in_batch:
        t_uq, t_uc = t_gs @ ac, t_gs.T @ aq
    else:
        t_uq, t_uc = np.einsum("bc,bcd->bd", t_gs, ac), t_gs[..., None] * aq[:, None, :]
    if cosine:  # G_x = (G_u - u (u . G_u)) / |x|, the unit vectors' rounding on top
        t_q = 2.0 * (t_uq + aq * np.sum(aq * t_uq, axis=-1, keepdims=True)) / np.linalg.norm(q, axis=-1,
                                                                                          keepdims=True)
        t_c = 2.0 * (t_uc + ac * np.sum(ac * t_uc, axis=-1, keepdims=True)) / np.linalg.norm(c, axis=-1,
                                                                                          keepdims=True)
    else:
        t_q, t_c = t_uq, t_uc
    t_p, t_n = _split_candidates(t_c, batch, None if n is None else n.shape, in_batch)
    out = {"o": t_o, "q": t_q, "p": t_p, "tau": np.asarray(np.sum((t_gz + g_z) * (np.abs(z) + t_z)) / abs_tau)}
    if t_n is not None:
        out["n"] = t_n
    return out
