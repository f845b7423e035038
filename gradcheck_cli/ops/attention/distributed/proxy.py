"""Per-rank attention code on its ranks, presented to attention's engine for user code as a NumPy implementation
(``forward``/``backward`` on the global arrays): each call shards the inputs (and the loss's upstream gradients) by
the scenario's sharding, runs every rank at once (:class:`.ranks.Ranks`), and puts the ranks' outputs and gradients
back at their global rows. Replicated parameters (sinks, ALiBi slopes) have their gradients summed over the ranks.
So everything the engine does for one process (the float64 reference, finite differences of the gathered forward on
copies stacked along the batch axis, the invariants, the hints) checks the distributed code as it is.

The ranks get FlashAttention's arguments: ``group``, ``q_positions`` and ``k_positions`` (the global rows of the
local shard, int64), ``softmax_scale``, ``causal`` and ``window_size`` (from the scenario's mask,
:func:`keys.band_of`: within each document of a packed batch, whose ``cu_seqlens_q=`` and ``cu_seqlens_k=`` are the
global offsets), the stage arguments the scenario sets (``softcap=``, ``sinks=``, ``alibi_slopes=``) and
``return_lse=True`` with ``outputs: [o, lse]``."""
from __future__ import annotations

import atexit
import time

import numpy as np

from . import keys, sharding, wire
from .ranks import Ranks

#: The per-rank function of the tool's own ring attention (the scenario names no implementation).
BUILT_IN = {"contiguous": "gradcheck_cli.ops.attention.distributed.ring:ring_attention",
            "zigzag": "gradcheck_cli.ops.attention.distributed.ring:ring_attention",
            "per-document": "gradcheck_cli.ops.attention.distributed.ring:ring_attention",
            "ulysses": "gradcheck_cli.ops.attention.distributed.ring:ulysses_attention"}

#: The ranks of this process by what they run (world size, backend, the code, its folder, dtype, device): started
#: once and reused by every build of the scenario (its negative controls pass their fault with each call); ranks of
#: other code or settings are stopped first (other world sizes of the same code are kept), and all of them at exit.
_LIVE: dict = {}


def _ranks(key: tuple, deadline: float) -> tuple[Ranks, bool]:
    """(the ranks for ``key``, whether they were started now)."""
    ranks = _LIVE.get(key)
    fresh = ranks is None or bool(ranks.dead)
    if fresh:  # ranks of other code or settings stopped; the same code on another world size kept (one rank's
        # answers are an invariant of every distributed scenario)
        for other in [k for k in _LIVE if k[1:] != key[1:] or k == key]:
            _LIVE.pop(other).stop()
        ranks = _LIVE[key] = Ranks(*key, deadline)
    ranks.deadline = deadline
    return ranks, fresh


class Proxy:
    def __init__(self, sc, param_kwargs: tuple[str, ...] = (), faults: tuple[str, ...] = ()):
        """``param_kwargs``: the keyword arguments whose gradients the backward returns after dq, dk, dv (summed over
        ranks), in that order; ``faults``: the built-in ring's faults to switch on."""
        given = keys.settings(sc)
        self.ws, self.kind = given["world_size"], given["sharding"]
        spec = sc.implementation or BUILT_IN[self.kind]
        # JAX code: one process holding world_size devices, the rows in rank order along one sharded axis
        self.jax = sc.implementation is not None and sc.backend == "jax"
        self.ranks, fresh = _ranks((self.ws, "jax" if self.jax else given["backend"], spec, str(sc.base_dir),
                                    sc.dtype, sc.device), time.monotonic() + 0.8 * sc.timeout)
        self.index = keys.rows_of(sc)
        if self.jax:
            self.index = [np.concatenate(self.index)]
        self.n, self.batch = sc.n_q, sc.batch
        self.axis = 2 if sc.convention.layout == "bhnd" else 1
        self.lse_axis = 2 if sc.convention.lse_layout == "bhn" else 1
        left, right = keys.band_of(sc)
        self.base = {"softmax_scale": float(sc.scale), "causal": right == 0, "window_size": (left, right)}
        if sc.implementation is None:  # the built-in ring: told the shards' lengths, and the faults to switch on
            self.base["shard_lengths"] = [len(idx) for idx in self.index]
            if faults:
                self.base["fault"] = ",".join(faults)
        self.param_kwargs = tuple(param_kwargs)
        # the fault of the gathering itself: a replicated parameter's gradient as one rank holds it, not summed
        self.summed = "cp-param-not-summed" not in faults
        self.startup_s = self.ranks.startup_s if fresh else 0.0

    def _payloads(self, q, k, v, given: dict, backward: bool, return_lse: bool, grads: dict) -> list:
        out = []
        qkv = (("q", q), ("k", k), ("v", v))
        moved = {t: wire.differing(x, self.batch) for t, x in qkv}  # the copies sent as one and their differences
        for idx in self.index:
            part = {t: wire.pack(x, self.batch, moved[t], idx, self.axis) for t, x in qkv}
            for name, (x, axis) in grads.items():
                part[name] = sharding.shard(x, idx, axis)
            out.append({**part, "backward": backward, "return_lse": return_lse,
                        "lse_shape": sharding.lse_shape(part["q"].shape, self.axis, self.lse_axis),
                        "params": self.param_kwargs if backward else (),
                        "kwargs": {**self.base, **given, "q_positions": idx, "k_positions": idx}})
        if self.jax:  # the positions a sharded input, the arrays' axes named
            kwargs = out[0].pop("kwargs")
            out[0].update(positions=kwargs.pop("q_positions"), axis=self.axis, lse_axis=self.lse_axis,
                          kwargs={k: x for k, x in kwargs.items() if k != "k_positions"})
        return out

    def forward(self, q, k, v, visible, scale, kv_map, return_lse: bool = False, **given):
        batch = q.shape[0]
        if self.jax:  # the batch (perturbed copies) padded to a power of two: a few compiled programs serve them all
            q, k, v = (_padded(x, 1 << (batch - 1).bit_length()) for x in (q, k, v))
        answers = self.ranks.call(self._payloads(q, k, v, given, False, return_lse, {}), what="forward")
        o = sharding.gather([a["o"][:batch] for a in answers], self.index, self.axis, self.n)
        if not return_lse:
            return o
        return o, sharding.gather([a["lse"][:batch] for a in answers], self.index, self.lse_axis, self.n)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, grad_lse=None, **given):
        grads = {"grad_o": (grad_o, self.axis)}
        if grad_lse is not None:
            grads["grad_lse"] = (grad_lse, self.lse_axis)
        answers = self.ranks.call(self._payloads(q, k, v, given, True, grad_lse is not None, grads), what="backward")
        out = tuple(sharding.gather([a[t] for a in answers], self.index, self.axis, self.n) for t in "qkv")
        return out + tuple(np.sum([a[p] for a in answers], axis=0) if self.summed else answers[0][p]
                           for p in self.param_kwargs)


    # the arguments go to the ranks pickled, never to code in this process: nothing to copy or compare (they
    # get their own arrays, and what comes back is gathered into fresh ones)
    forward.immutable = backward.immutable = True


def _padded(x: np.ndarray, size: int) -> np.ndarray:
    """x with its first axis padded to ``size`` by repeating its first element."""
    if x.shape[0] == size:
        return x
    return np.concatenate([x, np.broadcast_to(x[:1], (size - x.shape[0],) + x.shape[1:])])


def stop_all() -> None:
    """Stop every rank this process started."""
    for ranks in _LIVE.values():
        ranks.stop()
    _LIVE.clear()


atexit.register(stop_all)
