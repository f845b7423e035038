"""The invariant of distributed attention beyond one process's: the gathered result does not depend on the world
size. The same code (or the built-in ring) on one rank, with the same inputs and upstream gradients, must give the
same O, LSE and gradients within the rounding of their terms (``same result on one rank``). Beside the reference
checks it says where a bug lives: code right on one rank and wrong on several has it in what the ranks exchange;
code wrong on one rank too has it in the attention itself (``hints.py`` reads ``facts``).

The other promises are the one-process invariants applied to the gathered result: the gradient of K/V rows a rank's
queries never see is zero (``unseen K/V rows get zero gradient``, per row and for row 0), hidden rows do not change
O, and O stays finite where a rank's blocks are all hidden (a ring's LSE of -inf for such a block must merge to no
NaN: ``implementation runs`` fails on a non-finite value, naming the tensor and index)."""
from __future__ import annotations

import dataclasses

import numpy as np

from ....implementation import ImplementationFailure
from ....implementation.failures import failure_check
from ....result import Check, Kind
from . import keys

NAME = keys.ONE_RANK


def on_ranks(sc, world_size: int):
    """The scenario with another world size."""
    params = tuple((key, tuple((f, world_size if f == "world_size" else v) for f, v in value) if key == keys.KEY
                    else value) for key, value in sc.params)
    return dataclasses.replace(sc, params=params)


def one_rank_checks(sc, faults, results: dict, reference: dict, allowed: dict, unit: float, build) -> list[Check]:
    """One check per result (o, lse, q, k, v, the parameters): the scenario's ``results`` against the same code's
    on one rank (``build``: the engine's build of a scenario), each element within twice ``allowed`` (per element,
    the rounding of the reference's terms) or ``unit`` times its own size, whichever is larger."""
    given = keys.settings(sc)
    ws = given["world_size"]
    if ws < 2:
        return []
    try:
        arrays = build(on_ranks(sc, 1), faults).arrays
    except ImplementationFailure as exc:
        return [failure_check(NAME, exc, prefix="on one rank: ")]
    one = {"o": arrays["output"], "lse": arrays.get("lse"),
           **{t: arrays[f"analytic_{t}"] for t in results if f"analytic_{t}" in arrays}}
    layout = f"{ws} ranks{'' if given['sharding'] == 'contiguous' else ', ' + given['sharding']}"
    checks = []
    for t, mine in results.items():
        theirs = one.get(t)
        if theirs is None:
            continue
        mine64, theirs64 = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
        # twice the rounding of its terms, or of the values themselves where code that is wrong makes them larger
        # than the reference's terms (the same wrong result on one rank rounds as much)
        scale = np.maximum(np.abs(mine64), np.abs(theirs64))
        bound = 2.0 * np.maximum(np.broadcast_to(np.asarray(allowed[t], dtype=np.float64), mine64.shape),
                                 unit * np.where(np.isfinite(scale), scale, 0.0))
        with np.errstate(invalid="ignore"):
            diff = np.abs(mine64 - theirs64)
            over = np.where(np.isfinite(diff), diff / np.maximum(bound, np.finfo(np.float64).tiny), np.inf)
        worst = np.unravel_index(int(np.argmax(over)), diff.shape) if diff.size else ()
        index = tuple(int(i) for i in worst)
        passed = bool(diff.size == 0 or (np.isfinite(diff).all() and (diff <= bound).all()))
        right = bool(np.all(np.abs(theirs64 - reference[t]) <= bound)) if t in reference else None
        largest = float(diff[worst]) if diff.size else 0.0
        checks.append(Check(
            kind=Kind.INVARIANT, name=NAME, tensor=t, shape=tuple(mine64.shape), max_abs_error=largest,
            relative_error=largest, tolerance=float(bound[worst]) if diff.size else 0.0, noise_floor=0.0,
            worst_index=index, passed=passed,
            detail=f"the same code on 1 rank and on {layout}: {t}[{', '.join(map(str, index))}] is "
                   f"{float(mine64[worst]):.9g} on {ws}, {float(theirs64[worst]):.9g} on 1 (allowed "
                   f"{float(bound[worst]):.3g}: twice the rounding of its terms)" + (
                       "" if right is None else "; on 1 rank it agrees with the reference" if right
                       else "; on 1 rank it disagrees with the reference too"),
            facts={"one_rank_right": right}))
    return checks
