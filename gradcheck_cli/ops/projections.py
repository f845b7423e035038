"""Attention with its projections (A.10.10-A.10.11 and the A.10.5 head layout): X -> Q, K, V -> heads ->
attention -> heads merged -> output projection, in the row-major convention Q = X W_Q.

Shapes (extra leading axes broadcast): x [B, n_q, d_model]; for ``source: cross`` a memory
m [B, n_k, d_model] feeds K and V (for ``self`` it is x); W_Q [d_model, Hq*d_head],
W_K [d_model, Hkv*d_head], W_V [d_model, Hkv*d_value], W_O [Hq*d_value, d_model]; y [B, n_q, d_model].
Heads are split as [B, n, H*d] -> [B, H, n, d] (reshape, then swap the head and sequence axes) and
merged by the inverse permutation.

Backward: G_merged = G_Y W_O^T, G_WO = merged^T G_Y; G_heads = split(G_merged); attention's backward
(with the GQA sum) gives G_Q, G_K, G_V per head; merged back to [B, n, H*d]; G_WQ = X^T G_Q,
G_WK = S^T G_K, G_WV = S^T G_V for the source S of K/V. G_X = G_Q W_Q^T + G_K W_K^T + G_V W_V^T when K
and V come from X (the three paths of A.10.11); for cross-attention G_X = G_Q W_Q^T and
G_M = G_K W_K^T + G_V W_V^T: only paths that really share an input are summed.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from .. import invariants
from ..numeric import SeedStream
from ..tolerance import INVARIANT_ULPS
from . import attention, dense, user_engine
from .attention import memory as attention_memory
from .attention.hints.known_forward import mask_variants
from .attention.space import AXES as ATTENTION_AXES
from .convention import interleaved_kv_map
from .registry import HEAD_EDGES, Axis, Fault, Interface, Op, Param, Structure, user_code_engines

FAULTS = {f.name: f for f in (
    Fault("shared-input-sum", "G_X = G_Q W_Q^T only: drops the K and V paths of a shared input "
                              "(no effect on cross-attention, where X feeds only Q)",
          ("gradient x",), user=user_engine.ADDED),
    Fault("head-merge", "the backward splits G_merged and merges G_Q, G_K, G_V by a bare reshape, without "
                        "the inverse head/sequence permutation (no effect with one head or one row)",
          ("gradient x", "gradient m", "gradient w_q", "gradient w_k", "gradient w_v",
           "unseen x rows get zero gradient"), user=user_engine.ADDED),
)}
#: Known mistakes of a projection layer's backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by ``Layer.backward`` on request.
MISTAKES = {
    "projections-no-v-path": "G_X (or G_M) misses the V path G_V W_V^T of its sum (Q and K counted)",
    "projections-no-k-path": "G_X (or G_M) misses the K path G_K W_K^T of its sum (Q and V counted)",
    "projections-dw-mean": "the weight gradients are averaged over the rows (batch x sequence) instead of summed",
    "projections-split-reshape": "the backward splits G_O = G_Y W_O^T into heads by a bare reshape [B, n, H*d] -> "
                                 "[B, H, n, d], without the head/sequence permutation the forward's split has",
    "projections-merge-reshape": "the backward merges G_Q, G_K, G_V back to [B, n, H*d] by a bare reshape, without "
                                 "the inverse head/sequence permutation",
    "projections-v-path-through-wk": "the V path of G_X (or G_M) goes through W_K: G_V W_K^T where G_V W_V^T belongs",
    "projections-dwv-from-x": "cross-attention: G_WV taken from the query input x (x^T G_V) where the memory m's "
                              "(m^T G_V) belongs",
    "projections-dwk-from-x": "cross-attention: G_WK taken from the query input x (x^T G_K) where the memory m's "
                              "(m^T G_K) belongs",
    "projections-k-path-through-wv": "the K path of G_X (or G_M) goes through W_V: G_K W_V^T where G_K W_K^T belongs",
}
#: The attention faults flow through unchanged (their names mean the same thing here, on a user's implementation
#: too: ``mask`` shows it every key as visible, the others add their change to the reference gradients).
ALL_FAULTS = {**FAULTS, **attention.ENGINE_FAULTS}
#: What the ``mask`` fault shows a user's implementation (``UserOp.shown``): every key visible.
SHOWN = {"mask": lambda args: {**args, "visible": np.ones_like(args["visible"])}}


def split(t, heads: int, faults: Collection[str] = ()):
    """[..., n, H*d] -> [..., H, n, d]; the ``head-merge`` fault reshapes without the permutation."""
    n = t.shape[-2]
    if "head-merge" in faults:
        return t.reshape(t.shape[:-2] + (heads, n, -1))
    return np.swapaxes(t.reshape(t.shape[:-1] + (heads, -1)), -3, -2)


def merge(t, faults: Collection[str] = ()):
    """[..., H, n, d] -> [..., n, H*d], the inverse of :func:`split`."""
    heads, n, d = t.shape[-3:]
    if "head-merge" in faults:
        return t.reshape(t.shape[:-3] + (n, heads * d))
    return np.swapaxes(t, -3, -2).reshape(t.shape[:-3] + (n, heads * d))


def _rows(t):
    return t.reshape(-1, t.shape[-1])


class Layer:
    """One scenario's fixed parts: visible set, heads, scale, and whether K/V read x or a memory."""

    def __init__(self, sc):
        self.visible, self.hidden = sc.visible, ~sc.visible
        self.kv_map = np.asarray(sc.kv_map, dtype=np.intp)
        self.heads_q, self.heads_kv, self.scale = sc.heads_q, sc.heads_kv, sc.scale
        self.cross = sc.p("source") == "cross"

    def forward(self, x, w_q, w_k, w_v, w_o, m=None, faults: Collection[str] = (), scale=None, visible=None,
                reshape: str = ""):
        """y [..., B, n_q, d_model]; ``scale``, ``visible``: others than the scenario's, ``reshape``: the heads split
        ("split"), merged ("merge") or both ("both") by a bare reshape (a forward's known mistakes)."""
        s = m if self.cross else x
        split_by = ("head-merge",) if reshape in ("both", "split") else ()
        q = split(x @ w_q, self.heads_q, split_by)
        k, v = split(s @ w_k, self.heads_kv, split_by), split(s @ w_v, self.heads_kv, split_by)
        shown = self.visible if visible is None else visible
        o = attention.forward(q, k, v, shown, self.scale if scale is None else scale, self.kv_map, faults, ~shown)
        return merge(o, ("head-merge",) if reshape in ("both", "merge") else ()) @ w_o

    def backward(self, x, w_q, w_k, w_v, w_o, grad_y, m=None, faults: Collection[str] = (), visible=None) -> dict:
        """The gradients; ``visible``: another visible set than the scenario's (a batch element's alone)."""
        s = m if self.cross else x
        shown = self.visible if visible is None else visible
        q = split(x @ w_q, self.heads_q)
        k, v = split(s @ w_k, self.heads_kv), split(s @ w_v, self.heads_kv)
        o = attention.forward(q, k, v, shown, self.scale, self.kv_map, faults, ~shown)
        merged = merge(o)
        split_faults = (*faults, "head-merge") if "projections-split-reshape" in faults else faults
        merge_faults = (*faults, "head-merge") if "projections-merge-reshape" in faults else faults
        g_o = split(grad_y @ w_o.T, self.heads_q, split_faults)
        att = attention.backward(q, k, v, shown, self.scale, self.kv_map, g_o, faults)
        g_q, g_k, g_v = merge(att.q, merge_faults), merge(att.k, merge_faults), merge(att.v, merge_faults)
        s_k = x if "projections-dwk-from-x" in faults and self.cross else s
        s_v = x if "projections-dwv-from-x" in faults and self.cross else s
        if (s_k is x or s_v is x) and self.cross and x.shape != s.shape:
            raise ValueError("x and m differ in shape")
        grads = {"w_q": _rows(x).T @ _rows(g_q), "w_k": _rows(s_k).T @ _rows(g_k), "w_v": _rows(s_v).T @ _rows(g_v),
                 "w_o": _rows(merged).T @ _rows(grad_y)}
        if "projections-dw-mean" in faults:  # averaged over the rows of every batch element instead of summed
            grads = {t: w / _rows(x).shape[0] for t, w in grads.items()}
        from_kv = (0 if "projections-no-k-path" in faults else g_k @ (
            w_v if "projections-k-path-through-wv" in faults else w_k).T) + (
            0 if "projections-no-v-path" in faults else g_v @ (
                w_k if "projections-v-path-through-wk" in faults else w_v).T)
        g_x = g_q @ w_q.T
        if self.cross:
            grads["x"], grads["m"] = g_x, from_kv
        else:
            grads["x"] = g_x if "shared-input-sum" in faults else g_x + from_kv
        return grads

    def terms(self, x, w_q, w_k, w_v, w_o, grad_y, m=None) -> dict[str, np.ndarray]:
        """The size of the terms of y and of each gradient (float64), composed through the projections from
        attention's own (``attention.term_sizes``: a softmax Jacobian that cancels, as with one visible key,
        is judged by what it is made of, never by its value)."""
        x, w_q, w_k, w_v, w_o, grad_y = (np.asarray(t, dtype=np.float64) for t in (x, w_q, w_k, w_v, w_o, grad_y))
        s = np.asarray(m, dtype=np.float64) if self.cross else x
        ax, as_, aq, ak, av, ao, ag = (np.abs(t) for t in (x, s, w_q, w_k, w_v, w_o, grad_y))
        inputs = {"q": split(x @ w_q, self.heads_q), "k": split(s @ w_k, self.heads_kv),
                  "v": split(s @ w_v, self.heads_kv)}
        a = attention.attention_weights(inputs["q"], inputs["k"], self.visible, self.scale, self.kv_map)
        att = attention.term_sizes(inputs, split(ag @ ao.T, self.heads_q), lambda span: a[..., span, :],
                                   self.scale, self.kv_map)
        t_q, t_k, t_v, t_o = (merge(att[t]) for t in "qkvo")
        # the projections' own products: |x| |W| under each input's terms
        t_q, t_k, t_v = t_q + merge(split(ax @ aq, self.heads_q)), t_k + merge(split(as_ @ ak, self.heads_kv)), \
            t_v + merge(split(as_ @ av, self.heads_kv))
        out = {"o": t_o @ ao, "w_q": _rows(ax).T @ _rows(t_q), "w_k": _rows(as_).T @ _rows(t_k),
               "w_v": _rows(as_).T @ _rows(t_v), "w_o": _rows(t_o).T @ _rows(ag)}
        from_kv = t_k @ ak.T + t_v @ av.T
        if self.cross:
            out["x"], out["m"] = t_q @ aq.T, from_kv
        else:
            out["x"] = t_q @ aq.T + from_kv
        return out


def _shapes(sc) -> dict:
    d, dh, dv = sc.p("d_model"), sc.d_head, sc.d_value
    out = {"x": (sc.batch, sc.n_q, d)}
    if sc.p("source") == "cross":
        out["m"] = (sc.batch, sc.n_k, d)
    out.update({"w_q": (d, sc.heads_q * dh), "w_k": (d, sc.heads_kv * dh), "w_v": (d, sc.heads_kv * dv),
                "w_o": (sc.heads_q * dv, d)})
    return out


def _magnitude(layer, data):
    """A bound on the absolute terms behind each y element (for the rounding of L)."""
    exact = {t: v.astype(np.float64) for t, v in data.items()}
    size = {t: np.abs(v) for t, v in exact.items()}
    src = "m" if layer.cross else "x"
    weights = attention.attention_weights(split(exact["x"] @ exact["w_q"], layer.heads_q),
                                          split(exact[src] @ exact["w_k"], layer.heads_kv),
                                          layer.visible, layer.scale, layer.kv_map)
    q = split(size["x"] @ size["w_q"], layer.heads_q)
    k = attention.repeat_kv(split(size[src] @ size["w_k"], layer.heads_kv), layer.kv_map)
    v = attention.repeat_kv(split(size[src] @ size["w_v"], layer.heads_kv), layer.kv_map)
    terms = (weights * (1.0 + abs(layer.scale) * (q @ np.swapaxes(k, -1, -2)))) @ v
    return merge(terms) @ size["w_o"]


def _data(sc) -> tuple[dict, np.ndarray]:
    """The seeded inputs and the upstream gradient g (zero outside ``loss_rows``)."""
    shapes = _shapes(sc)
    d = sc.p("d_model")
    scales = {"w_q": d ** -0.5, "w_k": d ** -0.5, "w_v": d ** -0.5, "w_o": (sc.heads_q * sc.d_value) ** -0.5}
    data = dense.seeded(sc, {**shapes, "g": shapes["x"][:2] + (d,)}, scales)
    g = data.pop("g")
    if sc.loss_rows is not None:
        keep = np.zeros(sc.n_q, dtype=bool)
        keep[list(sc.loss_rows)] = True
        g[..., ~keep, :] = 0
    return data, g


_STRUCTURE = {"x": Structure(("batch", "query row", "feature"), heat=("query row", "feature")),
              "m": Structure(("batch", "key row", "feature")),
              **{w: Structure(("d_in", "d_out")) for w in ("w_q", "w_k", "w_v", "w_o")}}


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    data, g = _data(sc)
    layer = Layer(sc)
    grads = layer.backward(**data, grad_y=g, faults=faults)

    def fwd(**t):
        return layer.forward(**t, faults=faults)

    def checks() -> list:
        return _invariants(sc, layer, data, faults)

    lift = {name: 1 for name in ("w_q", "w_k", "w_v", "w_o")}
    return dense.problem(
        sc, data, fwd, grads, g, lift=lift, magnitude=_magnitude(layer, data), invariants=checks,
        work_factor=4.0 * sc.heads_q * sc.n_k / sc.p("d_model") + 6, structure=_STRUCTURE,
        arrays={"visible": sc.visible, "scale": np.asarray(sc.scale), "kv_map": layer.kv_map})


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``): f(x, [m,] w_q, w_k, w_v, w_o,
    visible, scale, kv_map), every weight's gradient checked like x's; the mask invariants run on it."""
    data, g = _data(sc)
    layer = Layer(sc)
    order = tuple(data)
    args = {"visible": sc.visible, "scale": sc.scale, "kv_map": layer.kv_map}

    def forward(*values):
        return layer.forward(**dict(zip(order, values[:len(order)])))

    def backward(*values):  # (*inputs, *args, grad_y, faults): args start with the visible set
        grads = layer.backward(**dict(zip(order, values[:len(order)])), grad_y=values[-2], faults=values[-1],
                               visible=values[len(order)])
        return tuple(grads[t] for t in order)

    def checks(calls, dtype, y):
        return mask_invariants(sc, "m" if layer.cross else "x", data, calls.forward, calls.backward, dtype)

    return user_engine.build(sc, user_engine.UserOp(
        inputs=data, args=args, g=g, forward=forward, backward=backward,
        terms=lambda inputs, a, g: layer.terms(**inputs, grad_y=g), forward_mistakes=forward_mistakes(sc, layer, order),
        invariants=checks, batched=("x", "m", "visible"), structure=_STRUCTURE, shown=SHOWN,
        alternatives=kv_alternatives(sc, lambda kv: Layer(dataclasses.replace(sc, kv_map=kv)).forward(
            **{t: v.astype(np.float64) for t, v in data.items()})),
        mistakes=user_engine.mistakes(ALL_FAULTS, MISTAKES)), faults)


def forward_mistakes(sc, layer, order) -> dict:
    """Known mistakes of an attention layer's forward (``UserOp.forward_mistakes``): name -> (what it gets wrong, its
    forward on the inputs in ``order`` and the args)."""
    def with_(values, **kw):
        return layer.forward(**dict(zip(order, values[:len(order)])), **kw)

    def swapped(values):
        t = dict(zip(order, values[:len(order)]))
        if t["w_k"].shape != t["w_v"].shape:
            raise ValueError("W_K and W_V differ in shape")
        return layer.forward(**{**t, "w_k": t["w_v"], "w_v": t["w_k"]})

    def copied(values, target, source):
        t = dict(zip(order, values[:len(order)]))
        if t[target].shape != t[source].shape:
            raise ValueError("shapes differ")
        return layer.forward(**{**t, target: t[source]})

    def kv_from_x(values):
        t = dict(zip(order, values[:len(order)]))
        if not layer.cross or t["x"].shape != t["m"].shape:
            raise ValueError("self-attention, or x and m differ in shape")
        return layer.forward(**{**t, "m": t["x"]})

    out = {"projections-kv-from-x": ("cross-attention: K and V are projected from the query input x instead of the "
                                     "memory m", lambda *v: kv_from_x(v)),
           "projections-heads-reshape": ("the heads are split and merged by a bare reshape [B, n, H*d] -> [B, H, n, "
                                         "d], without swapping the head and sequence axes",
                                         lambda *v: with_(v, reshape="both")),
           "projections-split-reshape-forward": ("the heads are split by a bare reshape (.view(B, H, n, d) of [B, n, "
                                                 "H*d], no transpose); merged right",
                                                 lambda *v: with_(v, reshape="split")),
           "projections-merge-reshape-forward": ("the heads are merged by a bare reshape of [B, H, n, d] to [B, n, "
                                                 "H*d] (no transpose back); split right",
                                                 lambda *v: with_(v, reshape="merge")),
           **{f"projections-{t.replace('w_', '')}-from-{w.replace('w_', '')}": (
               f"{t[2:].upper()} is projected with {w.upper().replace('_', '_')} where {t.upper()} belongs (a "
               "copy-paste of the wrong line)", lambda *v, t=t, w=w: copied(v, t, w))
              for t in ("w_q", "w_k", "w_v") for w in ("w_q", "w_k", "w_v") if t != w},
           "projections-kv-weights-swapped": ("K is projected with W_V and V with W_K (the two weights swapped)",
                                              lambda *v: swapped(v))}
    for name, says, shown in mask_variants(sc, "forward"):
        out[name] = (says, lambda *v, shown=shown: with_(v, visible=shown))
    if not sc.visible.all():
        out["projections-mask-not-passed"] = ("the mask is not passed to the attention inside the layer (every key "
                                              "visible)", lambda *v: with_(v, visible=np.ones_like(sc.visible)))
    ignored = "the scale argument ignored, or the wrong size under the root"
    for name, value, said, why in (
            ("projections-scale-d-head", sc.d_head ** -0.5, "1/sqrt(d_head)", ignored),
            ("projections-scale-d-model", sc.p("d_model") ** -0.5, "1/sqrt(d_model)", ignored),
            ("projections-no-scale", 1.0, "1 (no scale)", ignored),
            ("projections-scale-twice", sc.scale ** 2, "the scale twice",
             "q pre-scaled, then the scores scaled again")):
        if abs(value - sc.scale) > 1e-12 * sc.scale:
            out[name] = (f"the scores are scaled by {said} = {value:.6g}, not by the scenario's scale {sc.scale:.6g} "
                         f"({why})", lambda *v, value=value: with_(v, scale=value))
    return out


def _invariants(sc, layer, data, faults) -> list:
    return mask_invariants(sc, "m" if layer.cross else "x", data,
                           lambda t: layer.forward(**t, faults=faults),
                           lambda t, g: layer.backward(**t, grad_y=g, faults=faults))


def kv_alternatives(sc, forward) -> dict:
    """The other KV-head layout, for the hint of a user's layer whose forward disagrees with the reference:
    ``forward(kv_map)``, the float64 built-in output with that head map."""
    if sc.heads_kv in (1, sc.heads_q) or sc.heads_q % sc.heads_kv:
        return {}
    out = {}
    group = sc.heads_q // sc.heads_kv
    for name, kv in (("kv_map: interleaved", interleaved_kv_map(sc.heads_q, sc.heads_kv)),
                     ("kv_map: contiguous", tuple(r // group for r in range(sc.heads_q)))):
        if tuple(kv) != tuple(sc.kv_map):
            out[name] = lambda kv=kv: forward(tuple(kv))
    return out


def mask_invariants(sc, source: str, data: dict, forward, backward, dtype: str | None = None) -> list:
    """What finite differences cannot see: the mask, through the whole layer. ``source`` is the input
    whose rows are the keys (x for self-attention, where a row is also a query; m for cross); ``dtype``, the
    precision the forward computes in (default the scenario's)."""
    rng = np.random.default_rng([sc.seed, SeedStream.INVARIANTS])
    eps = float(np.finfo(np.dtype(dtype or sc.dtype)).eps)
    # Key rows that query row i cannot see must not move y[i].
    seen_by = sc.visible.any(axis=1)  # [B, n_q, n_k]: some head of row i sees key j
    moved = np.zeros((seen_by.shape[0], seen_by.shape[2]), dtype=bool)  # [B, n_k]
    moved[:, seen_by.shape[-1] // 2:] = True  # move the later half of the key rows
    touched = (seen_by & moved[:, None, :]).any(axis=-1)  # [B, n_q]
    if source == "x":
        touched |= moved[:, :seen_by.shape[1]]  # in self-attention a moved row is also a query
    changed = dict(data)
    noise = rng.standard_normal(data[source].shape).astype(data[source].dtype) * 10
    changed[source] = np.where(moved[..., None], noise, data[source])
    y0, y1 = forward(data), forward(changed)
    still = (y1 - y0)[~touched]  # rows that see none of the moved rows; empty (vacuous) without a mask
    checks = [invariants.bounded(
        f"hidden {source} rows do not change y", "y", still,
        INVARIANT_ULPS * eps * max(float(np.abs(y0).max()), 1.0),
        f"the later half of the {source} rows replaced by random values; y rows that see none of them "
        f"({int((~touched).sum())} of {touched.size}) must not change")]
    # With loss on query row 0 only, key rows row 0 cannot see get exactly zero gradient.
    first = np.zeros(y0.shape, dtype=y0.dtype)
    first[..., 0, :] = rng.standard_normal(first[..., 0, :].shape)
    grads = backward(data, first)
    unseen = ~seen_by[:, 0, :]  # [B, n_k]
    if source == "x":
        unseen[:, 0] = False
    checks.append(invariants.bounded(
        f"unseen {source} rows get zero gradient", source, grads[source][unseen], 0.0,
        f"loss on query row 0 only; the {int(unseen.sum())} {source} rows it cannot see must get exactly zero "
        "gradient"))
    return checks


def _validate(params: dict, att: dict) -> list:
    if params["source"] == "self" and att["n_k"] != att["n_q"]:
        return [("n_k", f"self-attention reads K and V from x, so n_k must equal n_q={att['n_q']} (got {att['n_k']})",
                 "use source: cross for a separate memory of n_k rows")]
    return []



def _memory(sc) -> int:
    """Attention's estimate plus the projections' weights and activations."""
    return attention_memory.need(sc) + dense.tensor_need(_shapes(sc))


#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "d_model": 12, "d_head": 4, "n_q": 6, "heads_q": 4, "heads_kv": 2,
           "mask": {"causal": "lower-right"}}

#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, [m,] w_q, w_k, w_v, w_o, visible, scale, kv_map) -> y and backward(x, "
    "[m,] w_q, w_k, w_v, w_o, visible, scale, kv_map, grad_y) -> (dx, [dm,] dw_q, dw_k, dw_v, dw_o) (m: the "
    "memory of source: cross); torch: a callable f(same arguments) -> y, differentiated by autograd; jax: the "
    "same function on JAX arrays, differentiated by jax.vjp; x [B, n_q, d_model], weights [in, out] (Q = x W_Q), "
    "heads split as [B, n, H*d] -> [B, H, n, d], visible [B, Hq, n_q, n_k] (True = key visible), kv_map[h] the "
    "KV head of query head h"), args=("visible", "scale", "kv_map"), conventions=("mask", "mask_heads"))

#: The space ``attn-gradcheck hunt`` searches: attention's (n_k where the scenario sets it: cross-attention), and the
#: model width.
SPACE = tuple(dataclasses.replace(a, when_set=True) if a.key == "n_k" else a for a in ATTENTION_AXES) + (
    Axis("d_model", low=1, high=256, edges=HEAD_EDGES),)

OP = Op(name="attention-projections",
        summary="attention with Q/K/V/O projections and head split/merge: gradients of x (and m), W_Q, W_K, W_V, W_O",
        tensors=("x", "m", "w_q", "w_k", "w_v", "w_o"), faults=ALL_FAULTS,
        shared_keys=attention.scenario_keys.KEY_GROUP,
        **user_code_engines("gradcheck_cli.ops.projections"),
        backends=("numpy", "torch", "jax"), implementation=INTERFACE,
        keys={"d_model": Param("int", help="model width, e.g. 'd_model: 16'"),
              "source": Param("choice", "self", "self: K, V from x; cross: from a separate memory m of n_k rows",
                              choices=("self", "cross"))},
        validate=_validate, shapes=_shapes, memory=_memory,
        describe=lambda sc: f"{sc.p('source')} B={sc.batch} n_q={sc.n_q} n_k={sc.n_k} d_model={sc.p('d_model')} "
                            f"Hq={sc.heads_q} Hkv={sc.heads_kv} d={sc.d_head}/{sc.d_value} {sc.dtype} {sc.mode}",
        example=EXAMPLE, space=SPACE)
