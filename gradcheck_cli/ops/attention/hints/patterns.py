"""The hints read from the pattern of the gradients' errors: G_K and G_V swapped, the softmax's row-sum
term, a constant factor on one gradient or the scale on G_Q and G_K, and the GQA reduction."""
from __future__ import annotations

import numpy as np

from ....fingerprints import SAME_FACTOR
from ..formulas import backward, repeat_kv
from ..inputs import seeded_inputs
from .context import EXPLAINED, Context

#: The analytic G_K fails to sum to 0 over the keys when its sum exceeds this many tolerances of G_K's
#: size and this many times the finite differences' own sum (which a correct G_K matches).
SHIFT_MARGIN = 10
#: A fitted factor c this close to 1 is no factor against the float64 reference (its rounding only; against the
#: finite differences: ``fingerprints.NOT_A_FACTOR``).
NOT_A_FACTOR_REFERENCE = 1e-12
#: GQA: the query heads' weights in a KV head's error are unequal when they spread over more than this
#: fraction of the largest, and a head is named when its weight exceeds it (a missing or doubled head's
#: weighs about 1, the others' 0).
UNEQUAL = 0.5


def _swapped(evidence, failed) -> str | None:
    """The analytic G_K matches the finite differences of V and the analytic G_V those of K."""
    ek, ev = evidence.get("k"), evidence.get("v")
    if ek is None or ev is None or not ({"k", "v"} & failed) or ek.analytic.shape != ev.analytic.shape:
        return None
    both = ek.checked & ev.checked
    if not both.any():
        return None
    fits_k = np.abs(ek.analytic - ev.numeric)[both] <= ev.allowed[both]
    fits_v = np.abs(ev.analytic - ek.numeric)[both] <= ek.allowed[both]
    if fits_k.all() and fits_v.all():
        return ("G_K and G_V are swapped: the analytic G_K matches the finite differences of V, and G_V those of K "
                "(check the order the backward returns them in)")
    return None


def _shift_violation(evidence, failed, verdicts, broken, tolerance) -> str | None:
    """Softmax is shift invariant: moving every key by the same vector moves each score row by a
    constant, so the K gradients of a (batch, KV head) sum to zero over the keys. Evidence: the G_S
    invariant, or the analytic G_K not summing to 0 while the finite differences do, G_V is right and G_Q is wrong
    too (G_Q is made of the same G_S: a G_K wrong alone is no row-sum term, e.g. G_S untransposed in dK)."""
    message = ("softmax is shift invariant, so the row-sum term of its backward is missing or wrong: "
               "G_S = A * (G_A - rowsum(A * G_A))")
    if "score-gradient rows sum to 0" in broken:
        return "G_S rows do not sum to 0: " + message
    ev = evidence.get("k")
    if ev is None or "q" not in failed or verdicts.get("v") != "pass" or not ev.checked.all():
        return None
    total_a = float(np.abs(ev.analytic.sum(axis=-2)).max(initial=0.0))
    total_n = float(np.abs(ev.numeric.sum(axis=-2)).max(initial=0.0))
    size = float(np.abs(ev.analytic).max(initial=0.0))
    if total_a > SHIFT_MARGIN * tolerance * size and total_a > SHIFT_MARGIN * total_n:
        return (f"the analytic G_K does not sum to 0 over the keys (worst {total_a:.3g}; the finite differences "
                f"sum to {total_n:.1g}): " + message)
    return None


def _reference_factor(context: Context, t: str) -> float | None:
    """c when the implementation's gradient is c x the reference's, up to EXPLAINED of their difference."""
    a, r = context.gradients[t], context.reference_gradients[t]
    rr = float(np.sum(r * r))
    if not rr > 0:
        return None
    c = float(np.sum(a * r)) / rr
    gap = float(np.abs(a - r).max(initial=0.0))
    if abs(c - 1) <= NOT_A_FACTOR_REFERENCE or not float(np.abs(a - c * r).max(initial=0.0)) <= EXPLAINED * gap:
        return None
    return c


def _scale(sc, factors, verdicts) -> str | None:
    """G_Q and G_K share one factor while G_V is right: the scale of the score gradient."""
    c_q, c_k = factors.get("q"), factors.get("k")
    if c_q is None or c_k is None or verdicts.get("v") != "pass" or abs(c_q - c_k) > SAME_FACTOR * abs(c_q):
        return None
    ratio = (c_q + c_k) / 2
    head = f"G_Q and G_K are both {ratio:.4g} x their finite differences while G_V is right: "

    def near(c: float) -> bool:
        return abs(ratio - c) < SAME_FACTOR * abs(c)

    cap = sc.p("softcap")
    if cap and (near(1 / cap) or near(cap)):
        over = near(1 / cap)
        return head + (f"it is {'1/softcap' if over else 'the softcap'} ({ratio:.4g}): the softcap's derivative in "
                       "the backward, d(c tanh(S / c)) / dS = 1 - tanh^2(S / c), carries no factor of c "
                       f"({'divided' if over else 'multiplied'} by c here)")
    if near(1 / sc.scale) or near(sc.scale):
        why = (f"it is 1/scale ({1 / sc.scale:.4g}): the backward drops the scale" if near(1 / sc.scale) else
               f"it is the scale ({sc.scale:.4g}): the backward applies it twice")
        return (head + "the scale factor in the backward (G_Q = scale * G_S K, G_K = scale * G_S^T Q); " + why)
    if near(-1.0):
        return head + ("the sign of the score gradient is flipped: G_S = A (G_A - rowsum(A G_A)), not "
                       "A (rowsum(A G_A) - G_A)")
    drop = sc.p("dropout")
    p = None if drop is None else dict(drop).get("p")
    if p and (near(1 / (1 - p)) or near(1 - p)):
        return head + (f"it is {'1/(1 - p)' if near(1 / (1 - p)) else '1 - p'} (p = {p:g}): the dropout's rescaling "
                       f"is applied {'once too often' if near(1 / (1 - p)) else 'once too rarely'} on the way to G_S "
                       "(dP of the kept weights carries 1/(1 - p) once)")
    if near(1 / np.log(2)) or near(np.log(2)):
        return head + ("it is log2(e) or ln 2: a backward in the exp2 domain (scores times log2(e)) that does not put "
                       "the factor back, or puts it back twice")
    return head + ("one common factor on the score gradient G_S in the backward: where G_S is formed or scaled (the "
                   "scale, G_Q = scale * G_S K and G_K = scale * G_S^T Q" + (", or a score stage's derivative" if cap
                                                                            else "") + ", or a normaliser)")


def _gqa(sc, evidence, verdicts, kv_map, factors) -> str | None:
    """The error of a shared KV head's gradient is a mix of its query heads' shares with unequal weights
    (some heads missing, doubled or overwritten), while G_Q passes: the GQA reduction."""
    if verdicts.get("q") != "pass" or sc.heads_kv == sc.heads_q:
        return None
    shares = _head_shares(sc, kv_map)
    found = {}
    for t in ("k", "v"):
        ev = evidence.get(t)
        if ev is None or verdicts.get(t) != "fail" or factors.get(t) is not None or not ev.checked.all():
            continue
        error = ev.analytic - ev.numeric
        for g in range(sc.heads_kv):
            heads = np.flatnonzero(kv_map == g)
            e = error[:, g].ravel()
            if len(heads) < 2 or not np.abs(e).max(initial=0.0) > 0:
                continue
            basis = np.stack([shares[t][:, r].ravel() for r in heads], axis=1)
            w, *_ = np.linalg.lstsq(basis, e, rcond=None)
            left = float(np.linalg.norm(e - basis @ w))
            if left <= EXPLAINED * float(np.linalg.norm(e)) and np.ptp(w) > UNEQUAL * float(np.abs(w).max()):
                found.setdefault(g, {})[t] = [int(h) for h, x in zip(heads, w) if abs(x) > UNEQUAL]
    if not found:
        return None
    parts = "; ".join(f"KV head {g}: query head(s) {', '.join(map(str, sorted(set(sum(v.values(), [])))))} "
                      f"missing or counted extra in d{'/d'.join(t.upper() for t in v)}"
                      for g, v in sorted(found.items()))
    return (f"errors only in K/V gradients of KV heads shared by several query heads ({parts}), and G_Q is right: "
            "the GQA reduction must sum the gradients of every query head in a group (sum_groups)")


def _head_shares(sc, kv_map) -> dict[str, np.ndarray]:
    """Each query head's share of the float64 reference's dK and dV: [B, Hq, n_k, d]."""
    inputs, g = seeded_inputs(sc, dtype=np.float64)
    identity = np.arange(sc.heads_q)
    grads = backward(inputs["q"], repeat_kv(inputs["k"], kv_map), repeat_kv(inputs["v"], kv_map), sc.visible,
                     sc.scale, identity, g)
    return {"k": grads.k, "v": grads.v}
