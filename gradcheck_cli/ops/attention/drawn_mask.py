"""A keep mask the code draws (``dropout: {p, drawn_by: code}``): the code is passed ``dropout_p=`` and
``dropout_seed=`` and returns ``(o, keep_mask)`` (``(o, lse, keep_mask)``); :class:`Drawn` keeps the first call's
mask (the one the reference uses), notes a later call whose mask differs, and checks the kept fraction against a
binomial bound; :func:`own_mask` wraps the code (its global generators seeded with dropout_seed for each call)."""
from __future__ import annotations

import contextlib
import threading

import numpy as np

from ...result import Check, Kind

#: The binomial bound on the kept fraction of a mask the code draws, in standard deviations (two-sided false alarm
#: about 6e-7 for a fair mask).
BOUND_Z = 5.0
#: One call at a time under seeded global generators: the finite differences call the code from several threads,
#: and a generator seeded by one call must not be drawn from by another.
_LOCK = threading.RLock()


class Drawn:
    """The keep mask the code draws (``drawn_by: code``) from ``dropout_seed``: the first call's (``mask``), the
    first later call whose mask differed (``differs``), and what was wrong with a returned mask (``problem``)."""

    def __init__(self, code):
        """``code``: the stage's ``CodeMask`` (seed, p, shape), whose mask the first call sets."""
        self.code, self.seed, self.p, self.shape = code, code.seed, code.p, code.shape
        self.calls, self.differs, self.problem = 0, None, None

    @property
    def mask(self) -> np.ndarray | None:
        return self.code.mask

    def took(self, mask) -> None:
        """Record one call's mask (never raises: it may run inside a compiled JAX program's callback)."""
        with _LOCK:
            self._took(np.asarray(mask))

    def _took(self, m: np.ndarray) -> None:
        self.calls += 1
        if tuple(m.shape) != self.shape:
            self.problem = self.problem or (f"keep_mask must be [B, Hq, n_q, n_k] = {list(self.shape)}, got "
                                            f"{list(m.shape)}")
            return
        if m.dtype != bool:
            if not np.isin(m, (0, 1)).all():
                odd = float(m[~np.isin(m, (0, 1))].ravel()[0])
                self.problem = self.problem or (f"keep_mask must be boolean (or exactly 0 / 1), got a value {odd!r}"
                                                + (" (the mask already scaled by 1 / (1 - p)?)"
                                                   if abs(odd * (1 - self.p) - 1) < 1e-3 else ""))
                return
            m = m != 0
        if self.mask is None:
            self.code.mask = m.copy()
        elif self.differs is None and not np.array_equal(m, self.mask):
            index = tuple(int(i) for i in np.argwhere(m != self.mask)[0])
            self.differs = (self.calls, index)

    def failure(self):
        """An ImplementationFailure for a mask that could not be read, or None."""
        from ...implementation import ImplementationFailure
        return None if self.problem is None else ImplementationFailure(self.problem, "keep_mask")

    def checks(self, visible: np.ndarray) -> list:
        """The mask's checks: the same on every call, and its kept fraction within the binomial bound."""
        if self.mask is None:
            return []
        out = []
        if self.differs is not None:
            call, index = self.differs
            out.append(Check(kind=Kind.IMPLEMENTATION, name="keep mask the same on every call", tensor="keep_mask",
                             shape=self.shape, max_abs_error=1.0, relative_error=1.0, tolerance=0.0,
                             noise_floor=0.0, worst_index=index, passed=False,
                             detail=f"call {call} of {self.calls} returned a keep mask other than the first call's "
                                    f"(keep_mask[{', '.join(map(str, index))}] differs) with the same "
                                    f"dropout_seed={self.seed}: finite differences, the reference and the "
                                    "invariants compare separate calls, so the mask must be drawn from dropout_seed "
                                    "(torch.Generator().manual_seed(dropout_seed), jax.random.key(dropout_seed), "
                                    "np.random.default_rng(dropout_seed)) and not depend on the batch size"))
        seen = np.broadcast_to(visible, self.shape)
        n = int(seen.sum())
        kept = int(self.mask[seen].sum())
        expected, sd = n * (1 - self.p), (n * self.p * (1 - self.p)) ** 0.5
        allowed = BOUND_Z * sd + 0.5
        passed = abs(kept - expected) <= allowed
        out.append(Check(kind=Kind.INVARIANT, name="keep mask keeps 1 - p of the weights", tensor="keep_mask",
                         shape=self.shape, max_abs_error=abs(kept - expected) / max(n, 1),
                         relative_error=abs(kept - expected) / max(n, 1), tolerance=allowed / max(n, 1),
                         noise_floor=0.0, worst_index=None, passed=passed,
                         detail=f"kept {kept} of the {n} visible weights ({100 * kept / max(n, 1):.1f} %), 1 - p = "
                                f"{100 * (1 - self.p):g} % within {BOUND_Z:g} binomial standard deviations "
                                f"(+-{100 * allowed / max(n, 1):.1f} %)"
                                + ("" if passed else (" (the mask marks the dropped entries True?)"
                                                      if abs(kept - n * self.p) <= allowed else ""))
                                + f"; the same mask on all {self.calls} calls" * (self.differs is None)))
        return out


@contextlib.contextmanager
def seeded(seed: int, torch_too: bool):
    """torch's (with ``torch_too``) and NumPy's global generators seeded with ``seed``, restored after."""
    with _LOCK:
        with _seeded(seed, torch_too):
            yield


@contextlib.contextmanager
def _seeded(seed: int, torch_too: bool):
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        if torch_too:
            from ...flavours import torch as torch_flavour
            with torch_flavour.seeded(seed):
                yield
        else:
            yield
    finally:
        np.random.set_state(state)


def own_mask(impl, backend: str, drawn: Drawn):
    """The code with ``(o, keep_mask)`` returned (``(o, lse, keep_mask)``) as one with ``o`` (``(o, lse)``), each
    call's mask handed to ``drawn``; the global generators seeded with its ``dropout_seed`` for the call."""
    def split(out):
        from ...implementation import ImplementationFailure
        if not isinstance(out, (tuple, list)) or len(out) < 2:
            raise ImplementationFailure("with dropout: {drawn_by: code} the code returns (o, keep_mask) (or (o, lse, "
                                        f"keep_mask)), got {type(out).__name__}"
                                        + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
        *rest, mask = out
        return (rest[0] if len(rest) == 1 else tuple(rest)), mask

    if backend == "jax":
        import jax

        def jax_fn(*args, **kw):
            y, mask = split(impl(*args, **kw))
            jax.debug.callback(drawn.took, mask)  # runs in the compiled program, the mask as a NumPy array
            return y
        return jax_fn
    if backend == "torch":
        def torch_fn(*args, **kw):
            with seeded(drawn.seed, True):
                y, mask = split(impl(*args, **kw))
            drawn.took(mask.detach().cpu().numpy() if hasattr(mask, "detach") else mask)
            return y
        return torch_fn

    class Own:
        def forward(self, *args, **kw):
            with seeded(drawn.seed, False):
                y, mask = split(impl.forward(*args, **kw))
            drawn.took(mask)
            return y

        def backward(self, *args, **kw):
            with seeded(drawn.seed, False):
                return impl.backward(*args, **kw)
    return Own()
