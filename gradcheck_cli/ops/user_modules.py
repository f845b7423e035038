"""A user's module (the mapping form of ``implementation``: factory, weights, call) as the one callable the
shared user-code engine differentiates (``user_engine``), with the rows and hints that say what was mapped."""
from __future__ import annotations

import dataclasses

from .. import flavours
from ..result import Check, Kind

#: The callable made of each module, per factory, scenario sizes and flavour: built once per process (the
#: negative controls build a scenario once per fault; JAX compiles once per function).
_MODULES: dict[tuple, tuple] = {}


def _from_module(sc, factory, order: tuple[str, ...], arg_names: tuple[str, ...], shapes: dict) -> tuple:
    """(f, rows, hints, transposed, fixed): the one callable f(*inputs, *args) of the module the scenario's
    factory builds (``implementation.modules``), in its flavour; a passing ``implementation`` row that lists
    the parameters checked and those frozen; what to say when its forward disagrees with the reference (frozen
    parameters that are not zero, a mask ``call`` does not pass); ``transposed()``, the module with one square
    weight's expression transposed, for the hint of a missing ``.T``; and the op's arguments fixed inside the
    module (neither taken by the factory nor passed by ``call``), by name, with why."""
    from ..implementation import modules
    available = modules.sizes(sc, sc.n_q > 0)  # n_q is 0 outside the attention family
    key = (id(factory), sc.module, repr(sorted(available.items())), sc.backend)
    if key not in _MODULES:
        _MODULES[key] = (factory,) + flavours.from_module(sc, factory, available, sc.module, order, arg_names, shapes)
        # the factory kept: its id stays its own
    f, frozen, nonzero = _MODULES[key][1:]

    def transposed() -> list:
        """(what to write, the module's callable) with one square weight's expression transposed (for the hint
        of a forward that disagrees with the reference)."""
        from ..implementation.modules import Expr, expression_shape
        out = []
        def square(e) -> bool:
            shape = expression_shape(e, shapes)
            return len(shape) == 2 and shape[0] == shape[1]

        for i, (path, expr) in enumerate(sc.module.weights):
            flips = [Expr(expr.name, expr.parts, not expr.transpose)] if square(expr) else []
            flips += [Expr(None, expr.parts[:j] + (Expr(p.name, p.parts, not p.transpose),) + expr.parts[j + 1:],
                           expr.transpose) for j, p in enumerate(expr.parts) if square(p)]
            for flipped in flips:
                weights = sc.module.weights[:i] + ((path, flipped),) + sc.module.weights[i + 1:]
                out.append((f"{path}: {flipped}", flavours.from_module(sc, factory, available,
                                                          dataclasses.replace(sc.module, weights=weights),
                                                          order, arg_names, shapes)[0]))
        return out
    weights = ", ".join(f"{path} <- {expr}" for path, expr in sc.module.weights) or "none"
    call = ", ".join(f"{k}={n}" for k, n in zip(sc.module.keywords, sc.module.call)) if sc.module.keywords \
        else ", ".join(sc.module.call)
    detail = (f"module from {sc.implementation}, called with ({call}); weights checked: {weights}; "
              + (f"frozen (kept as the factory built them, not checked): {', '.join(frozen)}" if frozen
                 else "no other parameters"))
    hints = []
    if nonzero:
        hints.append(f"the module has parameters no weight maps that are not zero ({', '.join(nonzero)}): they "
                     "are part of its forward but not of the op's; map them, zero them in the factory, or build the "
                     "module without them (e.g. bias=False)")
    taken = modules.taken(factory, available)
    fixed = {a: f"{a} is fixed inside the module (its factory {sc.implementation} does not take {a} and call does "
                f"not pass it, so the value it uses is unknown): let the factory take {a}, as in "
                f"def factory(..., {a}), or pass it in call"
             for a in arg_names if a not in sc.module.call and a not in taken}
    if "visible" in arg_names and "visible" not in sc.module.call:
        hints.append(f"the module is called without the mask (call: {list(sc.module.call)}): if it takes one, pass "
                     f"it, e.g. call: {list(sc.module.call) + ['visible']}")
    return f, [Check(kind=Kind.IMPLEMENTATION, name="module parameters", tensor="-", shape=None, max_abs_error=0.0,
                     relative_error=0.0, tolerance=0.0, noise_floor=0.0, worst_index=None, passed=True,
                     detail=detail)], hints, transposed, fixed
