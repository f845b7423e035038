"""Hints for distributed attention: the ranks whose rows are wrong, in the ranks' terms, and the fingerprints of
known context-parallel mistakes (dK/dV left on the rank that computed them last instead of sent home)."""
from __future__ import annotations

import numpy as np

from . import keys

#: A rank's rows are wrong when their largest error exceeds this fraction of the tensor's largest error.
WRONG = 1e-3


def rank_hints(sc, context, failed: set[str], forward_wrong: bool, checks=()) -> list[str]:
    """Where the bug lives (the same code on one rank right or wrong), the ranks whose rows of O, dQ, dK, dV are
    wrong (where some are right), and a known mistake's fingerprint."""
    given = keys.settings(sc)
    if given is None or context is None:
        return []
    ws = given["world_size"]
    where = _where(checks, ws)
    if where:
        return [where, *_rows_and_fingerprints(sc, context, failed, forward_wrong, given)]
    return _rows_and_fingerprints(sc, context, failed, forward_wrong, given)


def _where(checks, ws: int) -> str | None:
    """On one rank right and on several wrong: the exchange; on one rank just as wrong: the attention itself."""
    one = [c for c in checks if c.name == keys.ONE_RANK]
    if not one:
        return None
    differ = [c for c in one if c.verdict == "fail"]
    wrong = any(c.verdict == "fail" and c.name in ("forward agrees with the reference",
                                                   "backward agrees with the reference",
                                                   "lse agrees with the reference") for c in checks)
    if differ and all(c.facts.get("one_rank_right") for c in differ):
        names = ", ".join("O" if c.tensor == "o" else "the LSE" if c.tensor == "lse" else "d" + c.tensor.upper()
                          if len(c.tensor) == 1 else "d" + c.tensor for c in differ)
        return (f"the same code on one rank is right, on {ws} ranks it is not ({names}): the bug is in what the ranks "
                "exchange or how their parts merge (the rotation and its direction, the LSE merge, dK/dV sent home, "
                "a rotated block's positions, a collective's axes), not in the attention of one block")
    if not differ and wrong:
        return ("the same code gives the same wrong result on one rank (distributed: {world_size: 1}): the bug is in "
                "the attention itself, not in what the ranks exchange")
    return None


def _rows_and_fingerprints(sc, context, failed: set[str], forward_wrong: bool, given: dict) -> list[str]:
    ws = given["world_size"]
    rows = keys.rows_of(sc)
    pairs = {t: (context.gradients[t], context.reference_gradients[t]) for t in "qkv" if t in failed}
    if forward_wrong:
        pairs = {"o": (context.output, context.reference()), **pairs}
    out = []
    if ws > 1 and given["sharding"] != "ulysses":
        wrong_by_tensor = {}
        for t, (mine, ref) in pairs.items():
            err = np.abs(np.asarray(mine, dtype=np.float64) - ref)
            worst = float(err.max(initial=0.0))
            if worst == 0:
                continue
            per_rank = [float(err[:, :, r].max(initial=0.0)) for r in rows]
            wrong_by_tensor[t] = [r for r, e in enumerate(per_rank) if e > WRONG * worst]
        named = {t: ranks for t, ranks in wrong_by_tensor.items() if 0 < len(ranks) < ws}
        if named:
            out.append("wrong only on some ranks' rows: " + "; ".join(
                f"{'O' if t == 'o' else 'd' + t.upper()} on the rows of rank{'s' if len(r) > 1 else ''} "
                f"{', '.join(map(str, r))}" for t, r in named.items())
                + f" (of {ws}; " + ", ".join(f"rank {r}: rows {_span(idx)}" for r, idx in enumerate(rows)) + ")")
    home = _not_sent_home(context, rows, failed)
    if home:
        out.append(home)
    factor = _world_factor(context, failed, ws)
    if factor:
        out.append(factor)
    return out


def _world_factor(context, failed: set[str], ws: int) -> str | None:
    """Every gradient world_size (or 1 / world_size) times the reference's: a loss or a gradient summed (or
    averaged) over the ranks once too often."""
    if ws < 2 or not {"q", "k", "v"} <= failed:
        return None
    ratios = []
    for t in "qkv":
        mine, ref = np.asarray(context.gradients[t], dtype=np.float64).ravel(), context.reference_gradients[t].ravel()
        c = float(mine @ ref / (ref @ ref)) if ref @ ref > 0 else 0.0
        if np.abs(mine - c * ref).max(initial=0.0) > 1e-6 * np.abs(ref).max(initial=1.0):
            return None
        ratios.append(c)
    for c, says in ((ws, f"world_size = {ws} times"), (1.0 / ws, f"1 / world_size = 1/{ws} of")):
        if all(abs(r - c) < 1e-6 * c for r in ratios):
            return (f"dQ, dK and dV are all {says} the reference's: a loss or gradient "
                    + ("summed over the ranks once too often (the backward of an all_gather sums over ranks: a loss "
                       "on the gathered output taken on every rank counts each term world_size times)" if c > 1 else
                       "averaged over the ranks where it should be summed"))
    return None


def _span(idx: np.ndarray) -> str:
    """Rows as ranges: 0-3, 10-11."""
    parts, start = [], int(idx[0])
    for a, b in zip(idx[:-1], idx[1:]):
        if b != a + 1:
            parts.append(f"{start}-{int(a)}" if int(a) != start else f"{start}")
            start = int(b)
    parts.append(f"{start}-{int(idx[-1])}" if int(idx[-1]) != start else f"{start}")
    return ", ".join(parts)


def _not_sent_home(context, rows, failed: set[str]) -> str | None:
    """dK/dV of each rank's rows equal to the reference's of the next rank's rows (equal shards): the ring's last
    rotation, which sends each block's dK/dV home to its owner, is missing."""
    if not {"k", "v"} & failed or len({len(r) for r in rows}) != 1 or len(rows) < 2:
        return None
    for t in ("k", "v"):
        mine, ref = np.asarray(context.gradients[t], dtype=np.float64), context.reference_gradients[t]
        shifted = np.concatenate([ref[:, :, rows[(r + 1) % len(rows)]] for r in range(len(rows))], axis=2)
        own = np.concatenate([mine[:, :, r] for r in rows], axis=2)
        scale = float(np.abs(ref).max(initial=0.0)) or 1.0
        if float(np.abs(own - shifted).max(initial=0.0)) > 1e-9 * scale:
            return None
    return ("each rank's dK and dV are exactly the next rank's rows' (rank r holds rank r + 1's): the ring's last "
            "rotation, which sends each K/V block's accumulated dK/dV home to its owner, is missing")
