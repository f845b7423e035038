"""Rotary position embedding at fixed positions (chapter 31, section 5): each pair of features is
rotated by the angle p * theta_k of its position p and frequency theta_k = base^(-2k / rotary_dim).

Shapes (extra leading axes broadcast): x [B, H, n, d_head] -> y of the same shape. Features past
``rotary_dim`` pass through. Layouts: ``half`` pairs feature k with k + rotary_dim/2 (GPT-NeoX, Llama),
``interleaved`` pairs 2k with 2k + 1 (GPT-J, the RoFormer paper).

Forward: (a, b) -> (a cos - b sin, a sin + b cos). For fixed positions this is an orthogonal linear
map, so the backward is its transpose: the upstream gradient rotated by the opposite angle.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np

from .. import invariants
from ..tolerance import INVARIANT_ULPS, machine_epsilon
from . import dense, user_engine
from .registry import HEAD_EDGES, SIZE_EDGES, Axis, Fault, Interface, Op, Param, Structure, user_code_engines

FAULTS = {f.name: f for f in (
    Fault("rope-transpose", "the backward rotates the gradient forward (by +angle) instead of by the opposite angle",
          ("gradient x", "backward is the transpose of the forward", "backward agrees with the reference"),
          user=user_engine.ADDED),
)}
LAYOUTS = ("half", "interleaved")


def angles(n: int, rotary_dim: int, base: float, offset: int = 0) -> np.ndarray:
    """[n, rotary_dim / 2] angles p * theta_k for positions p = offset .. offset + n - 1 (float64)."""
    theta = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    return (offset + np.arange(n, dtype=np.float64))[:, None] * theta[None, :]


def _pairs(rotary_dim: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    half = rotary_dim // 2
    if layout == "half":
        return np.arange(half), np.arange(half) + half
    return np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2)


#: Known mistakes of a RoPE backward (no CLI switch): candidate causes of a failed gradient check
#: (``fingerprints``), computed by the user engine's backward on request.
MISTAKES = {
    "rope-other-pairing": "the backward pairs the features the other way (half <-> interleaved) from the forward",
    "rope-backward-identity": "G_x = G_y: the rotation is treated as if it had no derivative",
    "rope-backward-cos-only": "G_x = G_y cos(theta): the sine terms of the inverse rotation are dropped",
    "rope-passthrough-zero": "partial rotary: the features past rotary_dim, which the forward passes through, get "
                             "gradient 0 instead of G_y",
    "rope-sign-first": "the transpose written with one sign wrong, in the first of each pair: G_a = g_a cos - g_b sin "
                       "(+ g_b sin belongs)",
    "rope-sign-second": "the transpose written with one sign wrong, in the second of each pair: G_b = g_a sin + g_b "
                        "cos (- g_a sin belongs)",
    "rope-pair-outputs-swapped": "the two features of each pair get each other's gradient (G_a and G_b written to "
                                 "each other's place)",
    "rope-backward-cos-negated": "the inverse rotation negates cos instead of sin (the gradient rotated by pi - angle: "
                                 "-1 times the right one)",
    "rope-backward-positions-from-zero": "the backward rebuilds its cos/sin table for positions 0 .. n-1: the "
                                         "position offset the forward's table has is lost",
    "rope-backward-first-position": "the backward rotates every position by the angles of the first one (cos[0], "
                                    "sin[0] broadcast: the position index or the cache offset lost)",
}
#: The other layout, for ``rope-other-pairing``.
_OTHER = {"half": "interleaved", "interleaved": "half"}


def _backward_cs(grad_y, cos, sin, layout: str, faults: Collection[str] = ()):
    """G_x for upstream grad_y, with a fault or known mistake on request."""
    if "rope-backward-identity" in faults:
        return grad_y.copy()
    if "rope-backward-cos-only" in faults:
        return rotate_cs(grad_y, cos, np.zeros_like(sin), layout)
    if "rope-backward-cos-negated" in faults:
        return rotate_cs(grad_y, -cos, sin, layout, +1.0)
    if "rope-other-pairing" in faults:
        layout = _OTHER[layout]
    if "rope-backward-first-position" in faults:
        if not np.any(sin[:1]):  # the first position's angle is 0: this is rope-backward-identity
            raise ValueError("the first position is not rotated")
        cos, sin = np.broadcast_to(cos[:1], cos.shape), np.broadcast_to(sin[:1], sin.shape)
    out = rotate_cs(grad_y, cos, sin, layout, +1.0 if "rope-transpose" in faults else -1.0)
    signs = {"rope-sign-first": 0, "rope-sign-second": 1}
    wrong = [signs[f] for f in faults if f in signs]
    if wrong or "rope-pair-outputs-swapped" in faults:
        first, second = _pairs(2 * cos.shape[-1], layout)
        a, b = grad_y[..., first], grad_y[..., second]
        c, s = cos.astype(grad_y.dtype), sin.astype(grad_y.dtype)
        if wrong == [0]:
            out[..., first] = a * c - b * s
        elif wrong == [1]:
            out[..., second] = a * s + b * c
        else:
            out[..., first], out[..., second] = out[..., second].copy(), out[..., first].copy()
    if "rope-passthrough-zero" in faults:
        out[..., 2 * cos.shape[-1]:] = 0
    return out


def rotate(x, theta, layout: str, sign: float = 1.0):
    """x [..., n, d] with pairs rotated by sign * theta [n, rotary_dim / 2]."""
    return rotate_cs(x, np.cos(theta).astype(x.dtype), np.sin(theta).astype(x.dtype), layout, sign)


def rotate_cs(x, cos, sin, layout: str, sign: float = 1.0):
    """x [..., n, d] with pairs rotated by the angles whose cosines and sines are ``cos``, ``sin``
    [n, rotary_dim / 2] (times ``sign``)."""
    first, second = _pairs(2 * cos.shape[-1], layout)
    cos, sin = cos.astype(x.dtype), (sign * sin).astype(x.dtype)
    a, b = x[..., first], x[..., second]
    out = x.copy() if x.flags.writeable else np.array(x)
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def _by_head(x, cos, sin, layout: str):
    """x [B, H, n, d] rotated with head h's angles taken from position h (the tables aligned with the heads axis)."""
    heads = x.shape[-3]
    if heads > cos.shape[0] or heads == 1:
        raise ValueError("fewer positions than heads")
    return rotate_cs(x, cos[:heads][:, None, :], sin[:heads][:, None, :], layout)


def _last_features(x, cos, sin, layout: str):
    """Partial rotary applied to the last rotary_dim features (the first ones passed through)."""
    r, d = 2 * cos.shape[-1], x.shape[-1]
    if r == d:
        raise ValueError("every feature is rotated")
    out = x.copy()
    out[..., d - r:] = rotate_cs(np.ascontiguousarray(x[..., d - r:]), cos, sin, layout)
    out[..., :d - r] = x[..., :d - r]
    return out


def _no_minus(x, cos, sin, layout: str):
    """The pairs mapped by (a cos + b sin, a sin + b cos): rotate_half without its minus sign."""
    first, second = _pairs(2 * cos.shape[-1], layout)
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first], out[..., second] = a * cos + b * sin, a * sin + b * cos
    return out


def _tables_interleaved(x, cos, sin, layout: str):
    """x cos_full + rotate_half(x) sin_full with the tables expanded by repeating each angle twice (the interleaved
    layout's expansion) under the half layout's rotate_half."""
    if layout != "half":
        raise ValueError("written for the half layout")
    h = cos.shape[-1]
    c, s = np.repeat(cos, 2, axis=-1), np.repeat(sin, 2, axis=-1)
    out = x.copy()
    a, b = x[..., :h], x[..., h:2 * h]
    out[..., :h] = a * c[..., :h] - b * s[..., :h]
    out[..., h:2 * h] = b * c[..., h:] + a * s[..., h:]
    return out


def _concatenated(x, cos, sin, layout: str):
    """The rotation with its pairs written back as [first of each pair..., second of each pair...] (a known mistake:
    the same as the rotation in the half layout)."""
    if layout != "interleaved":
        raise ValueError("the half layout is written back concatenated already")
    first, second = _pairs(2 * cos.shape[-1], layout)
    rotated = rotate_cs(x, cos, sin, layout)
    out = x.copy()
    out[..., :2 * cos.shape[-1]] = np.concatenate([rotated[..., first], rotated[..., second]], axis=-1)
    return out


def forward(x, theta, layout):
    return rotate(x, theta, layout, +1.0)


def backward(grad_y, theta, layout, faults: Collection[str] = ()):
    """G_x: the transpose of the rotation applied to G_y (the opposite angle); a fault or known mistake on request."""
    return _backward_cs(grad_y, np.cos(theta).astype(grad_y.dtype), np.sin(theta).astype(grad_y.dtype), layout,
                        faults)


def _theta(sc):
    return angles(sc.p("n"), sc.p("rotary_dim") or sc.p("d_head"), sc.p("base"), sc.p("position_offset"))


def _shapes(sc) -> dict:
    return {"x": (sc.batch, sc.p("heads"), sc.p("n"), sc.p("d_head"))}


def pair_norm_checks(x, y, theta, layout, grad_y, grad_x, label: str = "", precision: str | None = None) -> list:
    """Rotations keep the norm of every (position, pair); and <R u, w> = <u, R^T w> for the backward; to the
    rounding of ``precision``, the precision the code computes in (default the inputs' dtype)."""
    first, second = _pairs(2 * theta.shape[-1], layout)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    norm_in = np.hypot(x64[..., first], x64[..., second])
    norm_out = np.hypot(y64[..., first], y64[..., second])
    eps = machine_epsilon(precision or x.dtype.name)
    checks = [invariants.bounded(f"rotation keeps pair norms{label}", "y", norm_out - norm_in,
                                 INVARIANT_ULPS * eps * max(float(norm_in.max(initial=0.0)), 1.0),
                                 "| |(y_a, y_b)| - |(x_a, x_b)| | per position and rotated pair")]
    # adjoint (dot-product) test: <forward(x), G_y> must equal <x, backward(G_y)>
    lhs = float(np.sum(y64 * grad_y.astype(np.float64)))
    rhs = float(np.sum(x64 * grad_x.astype(np.float64)))
    scale = float(np.sum(np.abs(y64 * grad_y.astype(np.float64))))
    checks.append(invariants.bounded(f"backward is the transpose of the forward{label}", "g_x",
                                     np.asarray([lhs - rhs]), INVARIANT_ULPS * eps * max(scale, 1.0),
                                     f"<R x, G_y> = {lhs:.9g} against <x, R^T G_y> = {rhs:.9g} (R orthogonal, "
                                     "fixed positions)"))
    return checks


_STRUCTURE = {"x": Structure(("batch", "head", "position", "feature"), heat=("head", "position"))}


def _structure(sc) -> dict:
    """The axes of x, and its features as classes: the first and the second of each rotated pair, and the
    pass-through features past rotary_dim (a sign or a swap in one of the pair's two rows, a pass-through lost)."""
    shape = _shapes(sc)["x"]
    rotary = sc.p("rotary_dim") or sc.p("d_head")
    first, second = _pairs(rotary, sc.p("layout"))
    classes = {}
    for label, where in (("first feature of each rotated pair", first), ("second feature of each rotated pair", second),
                         ("pass-through features (past rotary_dim)", np.arange(rotary, shape[-1]))):
        if len(where):
            mask = np.zeros(shape[-1], dtype=bool)
            mask[where] = True
            classes[label] = np.broadcast_to(mask, shape)
    return {"x": Structure(_STRUCTURE["x"].axes, classes, _STRUCTURE["x"].heat)}


def _rounding(t):
    return {"x": np.broadcast_to(dense.rss(t, -1)[..., None], t.shape).copy()}  # its position


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    shape = _shapes(sc)["x"]
    data = dense.seeded(sc, {"x": shape, "g": shape})
    g = data.pop("g")
    theta, layout = _theta(sc), sc.p("layout")
    y = forward(data["x"], theta, layout)
    g_x = backward(g, theta, layout, faults)
    return dense.problem(
        sc, data, lambda x: forward(x, theta, layout), {"x": g_x}, g, magnitude=np.abs(data["x"]) + np.abs(y),
        invariants=lambda: pair_norm_checks(data["x"], y, theta, layout, g, g_x),
        rounding=_rounding, structure=_STRUCTURE,
        arrays={"angles": theta})


def _rotation_terms(v, cos, sin, layout: str) -> np.ndarray:
    """The size of the terms of a rotation of ``v`` (float64): |a cos| + |b sin| per rotated feature, |v| for
    the features that pass through."""
    v, cos, sin = (np.abs(np.asarray(t, dtype=np.float64)) for t in (v, cos, sin))
    first, second = _pairs(2 * cos.shape[-1], layout)
    out = v.copy()
    out[..., first] = v[..., first] * cos + v[..., second] * sin
    out[..., second] = v[..., first] * sin + v[..., second] * cos
    return out


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``): forward(x, cos, sin) with the
    cosines and sines of the angles [n, rotary_dim / 2] in the scenario's dtype, pairs as ``layout`` says."""
    shape = _shapes(sc)["x"]
    data = dense.seeded(sc, {"x": shape, "g": shape})
    g, layout, theta = data.pop("g"), sc.p("layout"), _theta(sc)
    args = {"cos": np.cos(theta).astype(sc.dtype), "sin": np.sin(theta).astype(sc.dtype)}

    zero = angles(sc.p("n"), sc.p("rotary_dim") or sc.p("d_head"), sc.p("base"))

    def backward_cs(x, cos, sin, grad_y, faults=()):
        if "rope-backward-positions-from-zero" in faults:  # a known mistake: the backward's own table, offset lost
            if not sc.p("position_offset"):
                raise ValueError("no position offset to lose")
            cos, sin = np.cos(zero), np.sin(zero)
        return (_backward_cs(grad_y, cos, sin, layout, faults),)

    rotary = sc.p("rotary_dim") or sc.p("d_head")
    slow = (sc.p("position_offset") + np.arange(sc.p("n")))[:, None] * sc.p("base") ** (
        -np.arange(rotary // 2) / rotary)
    forward_mistakes = {
        "rope-opposite-angle": ("the forward rotates by the opposite angle (rotate_half written cat(x2, -x1), or sin "
                                "with the wrong sign)", lambda x, cos, sin: rotate_cs(x, cos, sin, layout, -1.0)),
        "rope-forward-other-pairing": (f"the forward pairs the features the other way ({_OTHER[layout]}) from the "
                                       f"scenario's layout {layout}: set layout: {_OTHER[layout]} if that is your "
                                       "model's", lambda x, cos, sin: rotate_cs(x, cos, sin, _OTHER[layout])),
        "rope-frequencies-exponent": ("the frequencies are base^(-k / rotary_dim), not base^(-2k / rotary_dim) (the "
                                      "exponent's step of 2 lost when building the table)",
                                      lambda x, cos, sin: rotate_cs(x, np.cos(slow), np.sin(slow), layout)),
        "rope-rotate-half-no-minus": ("rotate_half is written cat(x2, x1) without negating x2: (a cos + b sin, b cos + "
                                      "a sin), not a rotation", lambda x, cos, sin: _no_minus(x, cos, sin, layout)),
        "rope-tables-interleaved": ("the half-width cos/sin tables are expanded interleaved (repeat each twice) where "
                                    "the rotate_half formula needs them concatenated [cos, cos]",
                                    lambda x, cos, sin: _tables_interleaved(x, cos, sin, layout)),
        "rope-angles-by-head": ("the cos/sin tables are broadcast on the wrong axis (unsqueezed at dim 1): head h "
                                "gets position h's angles at every position",
                                lambda x, cos, sin: _by_head(x, cos, sin, layout)),
        "rope-last-features": ("partial rotary: the rotation is applied to the last rotary_dim features instead of "
                               "the first", lambda x, cos, sin: _last_features(x, cos, sin, layout)),
        "rope-written-concatenated": ("the rotated pairs are written back concatenated [firsts, seconds] instead of "
                                      "in the layout they were read from (interleaved)",
                                      lambda x, cos, sin: _concatenated(x, cos, sin, layout)),
    }
    if sc.p("position_offset"):
        forward_mistakes["rope-positions-from-zero"] = (
            f"the forward's angles are those of positions 0 .. n-1: the position offset ({sc.p('position_offset')}, "
            "a KV cache's length) lost", lambda x, cos, sin: rotate_cs(x, np.cos(zero), np.sin(zero), layout))
    return user_engine.build(sc, user_engine.UserOp(
        inputs=data, args=args, g=g, forward=lambda x, cos, sin: rotate_cs(x, cos, sin, layout), backward=backward_cs,
        terms=lambda inputs, a, g: {"o": _rotation_terms(inputs["x"], a["cos"], a["sin"], layout),
                                    "x": _rotation_terms(g, a["cos"], a["sin"], layout)},
        invariants=lambda calls, dtype, y: pair_norm_checks(data["x"], y, theta, layout, g, calls()["x"],
                                                             precision=dtype),
        batched=("x",), rounding=_rounding, structure=_structure(sc), forward_mistakes=forward_mistakes,
        mistakes=user_engine.mistakes(FAULTS, MISTAKES)), faults)


def _validate(params: dict, _attention: dict) -> list:
    d, r = params["d_head"], params["rotary_dim"] or params["d_head"]
    if params["rotary_dim"] is not None and r > d:
        return [("rotary_dim", f"{r} is larger than d_head={d}", "use at most d_head")]
    if r % 2:
        key = "rotary_dim" if params["rotary_dim"] is not None else "d_head"
        return [(key, f"the rotary dimension must be even (pairs of features), got {r}", None)]
    return []


#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, cos, sin) -> y and backward(x, cos, sin, grad_y) -> dx; torch: "
    "a callable f(x, cos, sin) -> y, differentiated by autograd; jax: the same function on JAX "
    "arrays, differentiated by jax.vjp; cos and sin [n, rotary_dim / 2] of the angles, pairs as the "
    "scenario's layout says"), args=("cos", "sin"))

#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "heads": 2, "n": 6, "d_head": 8}

#: The space ``attn-gradcheck hunt`` searches: heads, positions, head width (odd ones are refused by the loader), the
#: rotated part and the position offset where the scenario sets them, and dtype; the layout and base are the code's.
SPACE = (Axis("dtype", "choice", choices=("float64", "float32")), Axis("batch", low=1, high=4),
         Axis("heads", low=1, high=8), Axis("n", low=1, high=300, edges=SIZE_EDGES),
         Axis("d_head", low=2, high=256, edges=HEAD_EDGES), Axis("rotary_dim", low=2, high=256, edges=HEAD_EDGES,
                                                                  when_set=True),
         Axis("position_offset", "choice", choices=(0, 1, 7, 2047, 2048, 4095), when_set=True))

OP = Op(name="rope", summary="rotary position embedding at fixed positions: gradient of x",
        tensors=("x",), faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.rope"),
        backends=("numpy", "torch", "jax"),
        implementation=INTERFACE,
        keys={"heads": Param("int", 1, "heads"),
              "n": Param("int", help="positions, e.g. 'n: 8'"),
              "d_head": Param("int", help="features per head, e.g. 'd_head: 8'"),
              "rotary_dim": Param("int", None, "features rotated (even; default d_head)"),
              "base": Param("float", 10000.0, "theta_k = base^(-2k/rotary_dim)"),
              "layout": Param("choice", "half", "half: pairs (k, k + rotary_dim/2); interleaved: (2k, 2k+1)",
                              choices=LAYOUTS),
              "position_offset": Param("int", 0, "position of the first row", minimum=0)},
        validate=_validate, shapes=_shapes,
        describe=lambda sc: f"B={sc.batch} H={sc.p('heads')} n={sc.p('n')} d={sc.p('d_head')} "
                            f"rotary={sc.p('rotary_dim') or sc.p('d_head')} {sc.p('layout')} base={sc.p('base'):g} "
                            f"{sc.dtype} {sc.mode}",
        example=EXAMPLE, space=SPACE)
