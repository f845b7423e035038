"""Attention's known mistakes as fingerprints (``gradcheck_cli.fingerprints``): the backward faults whose change the
float64 reference's gradients show (``DIFFERENCE_FAULTS``, the LSE's gradient ignored) and every backward fault of
the score stages in force (softcap, bias, ALiBi, sinks, dropout, ...), each evaluated on the scenario's own inputs.
Named only where attention's own hints name no cause: they read patterns of the same mistakes, and one cause is
said once."""
from __future__ import annotations

import numpy as np

from .... import fingerprints
from .. import lse as lse_output
from .. import stages as score_stages
from ..args import Args
from ..formulas import DIFFERENCE_FAULTS, FAULTS, attention_weights, backward, sum_groups
from .context import other_alignment


def _as_dict(grads) -> dict:
    return {"q": grads.q, "k": grads.k, "v": grads.v, **dict(grads.params)}


def candidates(sc, context, kv_map) -> tuple[list, dict]:
    """(the candidate wrong backwards, the correct gradients), both as dicts by tensor (float64)."""
    x = [np.asarray(context.inputs[t], dtype=np.float64) for t in "qkv"]
    g = np.asarray(context.g, dtype=np.float64)
    grad_lse = None if context.lse is None else np.asarray(context.lse[2], dtype=np.float64)
    args = Args(sc.visible, sc.scale, np.asarray(kv_map, dtype=np.intp), tuple(context.stages))

    def computed(faults=(), stages=None, visible=None):
        kw = args.but(**{k: v for k, v in (("stages", stages), ("visible", visible)) if v is not None}).kw
        return _as_dict(backward(*x, grad_o=g, faults=faults, grad_lse=grad_lse, **kw))

    out = [fingerprints.Candidate(f, FAULTS[f].breaks, lambda f=f: computed((f,))) for f in DIFFERENCE_FAULTS]
    if grad_lse is not None:
        out.append(fingerprints.Candidate("lse-grad-ignored", lse_output.FAULTS["lse-grad-ignored"].breaks,
                                          lambda: computed(("lse-grad-ignored",))))
    out += _mistakes(sc, args, x, g, computed)
    for name, fault in score_stages.FAULTS.items():
        if fault.forward:
            continue
        wrong = score_stages.inject(args.stages, args.visible, [name])[1]
        if wrong == args.stages:
            continue
        out.append(fingerprints.Candidate(name, fault.breaks, lambda wrong=wrong: computed(stages=wrong)))
    return out, computed()


def _mistakes(sc, args, x, g, computed) -> list:
    """Known mistakes of an attention backward without a CLI switch."""
    out = []
    aligned = other_alignment(sc)
    if aligned is not None:
        other, alt = aligned
        out.append(fingerprints.Candidate(
            "mask-backward-alignment", f"the backward's causal mask is aligned {other} while the forward's is "
            f"{sc.causal} (torch.tril, or SDPA's is_causal, in one pass and not the other)",
            lambda: computed(visible=alt)))
    if sc.n_q == sc.n_k:
        def untransposed():
            right = computed()
            a = attention_weights(*x[:2], **args.kw)
            return {**right, "v": sum_groups(a @ g, args.kv_map, x[2].shape[-3])}
        out.append(fingerprints.Candidate("dv-untransposed", "dV = A G_O without the transpose of A (A^T G_O; the "
                                          "shapes agree when n_q = n_k)", untransposed))
    return out


def named(sc, context, evidence, failed: set, kv_map) -> list[str]:
    """The fingerprint hint of a user's attention, or [] (built-in engines: no context)."""
    if context is None or context.g is None or not failed:
        return []
    found, right = candidates(sc, context, kv_map)
    return fingerprints.named(evidence, failed, found, right)
