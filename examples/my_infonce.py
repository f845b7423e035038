"""An InfoNCE retriever loss in NumPy, as a user would write it (DPR: each query's positive document, the
other queries' positives as in-batch negatives, and hard negatives), with its hand-written backward.

forward(q, p, n, tau) -> l [B]: q, p [B, dim], n [B, k, dim] hard negatives (k may be 0), tau a 0-d array.
backward(q, p, n, tau, grad_l) -> (dq, dp, dn, dtau).
"""
import numpy as np


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _unit_backward(x, g):
    """The gradient of x / |x| pulled back to x."""
    u = _unit(x)
    return (g - u * np.sum(u * g, axis=-1, keepdims=True)) / np.linalg.norm(x, axis=-1, keepdims=True)


class InfoNCE:
    def __init__(self, cosine=False, in_batch=True):
        self.cosine, self.in_batch = cosine, in_batch

    def _logits(self, q, p, n, tau):
        """(z [B, candidates], the candidates, the positive's column per query)."""
        b, d = q.shape
        if self.in_batch:  # every positive and every hard negative of the batch
            c = np.concatenate([p, n.reshape(-1, d)])
        else:  # the query's own positive (column 0) and hard negatives
            c = np.concatenate([p[:, None], n], axis=1)
        uq, uc = (_unit(q), _unit(c)) if self.cosine else (q, c)
        s = uq @ uc.T if self.in_batch else np.einsum("bd,bcd->bc", uq, uc)
        return s / tau, c, (np.arange(b) if self.in_batch else np.zeros(b, dtype=int))

    def forward(self, q, p, n, tau):
        z, _, pos = self._logits(q, p, n, tau)
        m = z.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
        return lse - z[np.arange(len(q)), pos]

    def _logit_gradient(self, z, pos, grad_l):
        a = np.exp(z - z.max(axis=-1, keepdims=True))
        a /= a.sum(axis=-1, keepdims=True)
        a[np.arange(len(z)), pos] -= 1.0
        return grad_l[:, None] * a

    def backward(self, q, p, n, tau, grad_l):
        z, c, pos = self._logits(q, p, n, tau)
        g_z = self._logit_gradient(z, pos, grad_l)
        g_s = g_z / tau
        uq, uc = (_unit(q), _unit(c)) if self.cosine else (q, c)
        if self.in_batch:
            dq, dc = g_s @ uc, g_s.T @ uq
        else:
            dq, dc = np.einsum("bc,bcd->bd", g_s, uc), g_s[..., None] * uq[:, None, :]
        if self.cosine:
            dq, dc = _unit_backward(q, dq), _unit_backward(c, dc)
        b = len(q)
        dp, dn = (dc[:b], dc[b:].reshape(n.shape)) if self.in_batch else (dc[:, 0], dc[:, 1:])
        dtau = np.asarray(-np.sum(g_z * z) / tau, dtype=q.dtype)
        return dq, dp, dn, dtau


class MissingNormaliser(InfoNCE):
    def _logit_gradient(self, z, pos, grad_l):
        # bug: the log-sum-exp is treated as a constant, so only the positive's logit gets a gradient
        g = np.zeros_like(z)
        g[np.arange(len(z)), pos] = -grad_l
        return g


infonce = InfoNCE()                                 # dot similarity, in-batch negatives (+ hard ones)
infonce_cosine = InfoNCE(cosine=True)               # cosine similarity, in-batch negatives
infonce_own = InfoNCE(in_batch=False)               # dot, each query's own positive and hard negatives
missing_normaliser = MissingNormaliser()
missing_normaliser_own = MissingNormaliser(in_batch=False)
