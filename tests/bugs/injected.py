"""Each op's own built-in forward and backward with one known mistake put in, as a user's NumPy implementation:
``injected:<op>__<mistake>`` (a mistake of the op's ``MISTAKES``, in the backward) or
``injected:<op>__forward__<mistake>`` (one of its ``FORWARD_MISTAKES``, with the right backward). The fingerprint
table test (tests/test_fingerprints.py) runs every one: each must be named by its own name (or together with the ones
that give the same gradients on the scenario)."""
import numpy as np

from gradcheck_cli.ops import layernorm, rmsnorm, rope, swiglu
from gradcheck_cli.ops.infonce import formulas as infonce


def _nce(n):
    return n if n.shape[-2] else None


#: op -> (forward(*inputs, *args), backward(*inputs, *args, grad_y, faults) -> tuple)
OPS = {
    "rmsnorm": (rmsnorm.forward, lambda x, gamma, eps, g, f: rmsnorm.backward(x, gamma, eps, g, f)),
    "layernorm": (layernorm.forward, lambda x, gamma, beta, eps, g, f: layernorm.backward(x, gamma, beta, eps, g, f)),
    "swiglu": (swiglu.forward, lambda x, w1, w3, w2, g, f: tuple(swiglu.backward(x, w1, w3, w2, g, f)[t]
                                                                 for t in ("x", "w1", "w3", "w2"))),
    "rope": (lambda x, cos, sin: rope.rotate_cs(x, cos, sin, "half"),
             lambda x, cos, sin, g, f: rope._backward_cs(g, cos, sin, "half", f)),
    "infonce": (lambda q, p, n, tau: infonce.forward(q, p, _nce(n), tau, "dot", True),
                lambda q, p, n, tau, g, f: (lambda d: (d["q"], d["p"], d.get("n", np.zeros_like(n)), d["tau"]))(
                    infonce.backward(q, p, _nce(n), tau, g, "dot", True, f))),
}


class Injected:
    def __init__(self, op: str, mistake: str, in_forward: bool):
        self.op, self.mistake, self.in_forward = op, mistake, in_forward

    def forward(self, *args):
        if self.in_forward:
            return {"rmsnorm": rmsnorm.FORWARD_MISTAKES, "layernorm": layernorm.FORWARD_MISTAKES,
                    "swiglu": swiglu.FORWARD_MISTAKES}[self.op][self.mistake][1](*args)
        return OPS[self.op][0](*args)

    def backward(self, *args):
        return OPS[self.op][1](*args, () if self.in_forward else (self.mistake,))


def _known(op: str) -> list[str]:
    from gradcheck_cli.ops import infonce as nce_op
    module = {"rmsnorm": rmsnorm, "layernorm": layernorm, "swiglu": swiglu, "rope": rope, "infonce": nce_op}[op]
    return [*module.MISTAKES, *getattr(module, "FORWARD_MISTAKES", {})]


def __getattr__(name: str):
    """``<op>__<mistake>`` with the mistake's '-' written '_' (an attribute name), and '.' written '_p_'."""
    op, _, mistake = name.partition("__")
    forward = mistake.startswith("forward__")
    mistake = mistake.removeprefix("forward__")
    found = next((m for m in _known(op) if m.replace("-", "_").replace(".", "_p_") == mistake), mistake)
    return Injected(op, found, forward)
