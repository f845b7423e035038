"""Hand-written InfoNCE backwards (DPR-style: in-batch negatives plus hard ones; dot or cosine similarity) with the
mistakes their authors make, written from scratch; see dense_bugs.py. forward(q, p, n, tau) -> l [B],
backward(q, p, n, tau, grad_l) -> (dq, dp, dn, dtau)."""
import numpy as np


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


class InfoNCE:
    """Correct."""
    cosine = False

    def sims(self, q, p, n):
        c = np.concatenate([p, n.reshape(-1, q.shape[1])])
        return ((_unit(q) @ _unit(c).T) if self.cosine else q @ c.T), c

    def forward(self, q, p, n, tau):
        z = self.sims(q, p, n)[0] / tau
        m = z.max(-1, keepdims=True)
        return (m[:, 0] + np.log(np.exp(z - m).sum(-1))) - np.diag(z[:, :len(q)])

    def softmax(self, z):
        a = np.exp(z - z.max(-1, keepdims=True))
        return a / a.sum(-1, keepdims=True)

    def unit_grad(self, x, g):
        u = _unit(x)
        return (g - u * (u * g).sum(-1, keepdims=True)) / np.linalg.norm(x, axis=-1, keepdims=True)

    def dtau(self, g_z, s, tau):
        return -np.sum(g_z * s) / tau ** 2

    def backward(self, q, p, n, tau, grad_l):
        s, c = self.sims(q, p, n)
        z = s / tau
        g_z = self.softmax(z)
        g_z[np.arange(len(q)), np.arange(len(q))] -= 1.0
        g_z *= grad_l[:, None]
        g_s = self.logit_to_sim(g_z, tau)
        if self.cosine:
            uq, uc = _unit(q), _unit(c)
            dq, dc = self.unit_grad(q, g_s @ uc), self.unit_grad(c, g_s.T @ uq)
        else:
            dq, dc = g_s @ c, g_s.T @ q
        b = len(q)
        return dq, dc[:b], dc[b:].reshape(n.shape), np.asarray(self.dtau(g_z, s, tau))

    def logit_to_sim(self, g_z, tau):
        return g_z / tau


class InfoNCECosine(InfoNCE):
    cosine = True


class InfoNCETauOnce(InfoNCE):
    def logit_to_sim(self, g_z, tau):
        return g_z  # "the temperature only scales the logits"


class InfoNCEDtauSign(InfoNCE):
    def dtau(self, g_z, s, tau):
        return np.sum(g_z * s) / tau ** 2


class InfoNCECosineNoProjection(InfoNCECosine):
    def unit_grad(self, x, g):
        return g / np.linalg.norm(x, axis=-1, keepdims=True)


class InfoNCESoftmaxAxis(InfoNCE):
    def softmax(self, z):
        a = np.exp(z - z.max(0, keepdims=True))
        return a / a.sum(0, keepdims=True)  # over the batch, the way a CLIP loss is written for the other side


class InfoNCENoNormaliser(InfoNCE):
    def softmax(self, z):
        return np.zeros_like(z)  # the log-sum-exp treated as a constant


class InfoNCEUpstreamIgnored(InfoNCE):
    def backward(self, q, p, n, tau, grad_l):
        return super().backward(q, p, n, tau, np.ones_like(grad_l))  # "the loss is a sum": G_l taken as 1


class InfoNCETimesTau(InfoNCE):
    def logit_to_sim(self, g_z, tau):
        return g_z * tau  # d(s / tau) / ds written as tau


class InfoNCEDtauOneTau(InfoNCE):
    def dtau(self, g_z, s, tau):
        return -np.sum(g_z * s) / tau  # one tau short


class InfoNCEDtauNoUpstream(InfoNCE):
    def backward(self, q, p, n, tau, grad_l):
        dq, dp, dn, _ = super().backward(q, p, n, tau, grad_l)
        s, _ = self.sims(q, p, n)
        g_z = self.softmax(s / tau)
        g_z[np.arange(len(q)), np.arange(len(q))] -= 1.0  # grad_l forgotten on this path
        return dq, dp, dn, np.asarray(self.dtau(g_z, s, tau))


class InfoNCENegativesOrder(InfoNCE):
    def backward(self, q, p, n, tau, grad_l):
        dq, dp, dn, dtau = super().backward(q, p, n, tau, grad_l)
        flat = dn.reshape(-1, n.shape[-1])
        return dq, dp, flat.reshape(n.shape[1], n.shape[0], -1).swapaxes(0, 1), dtau  # (k, B) order


class InfoNCECandidatesUntransposed(InfoNCE):
    def backward(self, q, p, n, tau, grad_l):
        dq, _, dn, dtau = super().backward(q, p, n, tau, grad_l)
        s, c = self.sims(q, p, n)
        g_z = self.softmax(s / tau)
        g_z[np.arange(len(q)), np.arange(len(q))] -= 1.0
        g_s = g_z * grad_l[:, None] / tau
        return dq, (g_s @ q)[:len(q)], dn, dtau  # g_s.T belongs; square when there are no hard negatives


IN = {"op": "infonce", "batch": 4, "dim": 8, "hard_negatives": 2, "learn_temperature": True, "temperature": 0.5}
COS = {**IN, "similarity": "cosine"}

BUGS = [
    ("InfoNCETimesTau", "infonce-tau-times", IN),
    ("InfoNCEDtauOneTau", "infonce-dtau-one-tau", IN),
    ("InfoNCEDtauNoUpstream", "infonce-dtau-no-upstream", IN),
    ("InfoNCENegativesOrder", "infonce-negatives-order", IN),
    ("InfoNCECandidatesUntransposed", "infonce-candidates-untransposed", {**IN, "hard_negatives": 0}),
    ("InfoNCE", None, {**IN, "hard_negatives": 0}),
    ("InfoNCE", None, IN),
    ("InfoNCECosine", None, COS),
    ("InfoNCETauOnce", "infonce-tau-once", IN),
    ("InfoNCEDtauSign", "infonce-dtau-sign", IN),
    ("InfoNCECosineNoProjection", "infonce-cosine-no-projection", COS),
    ("InfoNCESoftmaxAxis", "infonce-softmax-axis", IN),
    ("InfoNCENoNormaliser", "infonce-normaliser", IN),
    ("InfoNCEUpstreamIgnored", "infonce-upstream-ignored", IN),
]

for _name, _value in list(globals().items()):
    if isinstance(_value, type) and hasattr(_value, "backward"):
        globals()[_name + "_"] = _value()
