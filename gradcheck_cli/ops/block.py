"""A pre-norm transformer block: h = x + Attn(RMSNorm(x)) with RoPE on Q and K, y = h + SwiGLU(RMSNorm(h)).

Shapes (extra leading axes broadcast): x, y [B, n, d_model]; gamma_1, gamma_2 [d_model];
W_Q [d_model, Hq*d_head], W_K [d_model, Hkv*d_head], W_V [d_model, Hkv*d_value], W_O [Hq*d_value, d_model];
W_1, W_3 [d_model, d_ff], W_2 [d_ff, d_model].

Forward: h1 = RMSNorm(x; gamma_1); Q, K, V = split(h1 W_Q), split(h1 W_K), split(h1 W_V); Q, K = RoPE(Q),
RoPE(K) at positions 0..n-1; O = attention(Q, K, V) with the scenario's mask and GQA map;
h = x + merge(O) W_O; y = h + SwiGLU(RMSNorm(h; gamma_2); W_1, W_3, W_2).

Backward: every piece's own backward (``rmsnorm``, ``projections``, ``rope``, ``attention``, ``swiglu``)
in reverse order, with each residual adding its upstream gradient back: G_h = G_y + (RMSNorm_2 path),
G_x = G_h + (RMSNorm_1 path), and G_h1 the sum of the Q, K and V paths. Every fault of those ops
applies here under the same name.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection

import numpy as np

from .. import invariants
from ..tolerance import INVARIANT_ULPS
from . import attention, dense, projections, rmsnorm, rope, swiglu, user_engine
from .attention import memory as attention_memory
from .attention.hints.known_forward import mask_variants
from .attention.space import AXES as ATTENTION_AXES
from .projections import merge, split
from .registry import HEAD_EDGES, WIDTHS, Axis, Interface, Op, Param, Structure, user_code_engines

#: Every fault of the parts, under its own name (on a user's implementation as on the parts').
FAULTS = {**attention.ENGINE_FAULTS, **projections.FAULTS, **rope.FAULTS, **rmsnorm.FAULTS, **swiglu.FAULTS}
#: The known mistakes of the parts its backward computes with theirs (a user's block: candidate causes of a failed
#: check; each applies to every use of its part, both RMSNorms for rmsnorm's).
MISTAKES = {**rmsnorm.MISTAKES, **rope.MISTAKES, **swiglu.MISTAKES,
            "block-ffn-input-detached": "the feed-forward half's input h is detached (its norm reads h.detach(), or "
                                        "a checkpoint gone wrong): h gets G_y by the residual alone",
            "block-attention-input-detached": "the attention half's input is detached (its norm reads x.detach()): x "
                                              "gets G_h by the residual alone",
            "block-ffn-residual-missing": "the backward drops the residual y = h + FFN(h): h gets the feed-forward "
                                          "path's gradient alone, not G_y as well",
            "block-attention-residual-missing": "the backward drops the residual h = x + Attn(x): x gets the "
                                                "attention path's gradient alone, not G_h as well",
            "block-norm2-backward-gamma1": "the second RMSNorm's G_x is computed with gamma1 (a copy-paste; its "
                                           "G_gamma2 is right)",
            "block-q-rope-backward-identity": "the backward does not rotate dQ back through RoPE (dK is)",
            "block-k-rope-backward-identity": "the backward does not rotate dK back through RoPE (dQ is)",
            "block-q-rope-detached": "the rotated Q is detached (no gradient flows back through RoPE to W_Q and the "
                                     "first norm)",
            "block-k-rope-detached": "the rotated K is detached (a cached rotated key reused): no gradient flows back "
                                     "through it to W_K and the first norm"}
WEIGHTS = ("w_q", "w_k", "w_v", "w_o", "w1", "w3", "w2")
#: Known mistakes of a block's forward (``Block.wrong_forward`` computes each): named when a user's forward fails
#: against the reference and equals one.
FORWARD_MISTAKES = {
    "block-ffn-residual-missing-forward": "the feed-forward half has no residual: y = FFN(norm(h)), not h + "
                                          "FFN(norm(h))",
    "block-attention-residual-missing-forward": "the attention half has no residual: h = Attn(norm(x)), not x + "
                                                "Attn(norm(x))",
    "block-residual-from-normalised": "the attention residual adds the normalised input: h = RMSNorm(x) + Attn, "
                                      "not x + Attn",
    "block-post-norm": "the block is wired post-norm, norm(x + Attn(x)) then norm(h + FFN(h)), where pre-norm x + "
                       "Attn(norm(x)) belongs",
    "block-rope-on-v": "RoPE is applied to V as well as to Q and K",
    "block-rope-q-only": "RoPE is applied to Q only (K left unrotated)",
    "block-rope-k-only": "RoPE is applied to K only (Q left unrotated)",
    "block-ffn-from-x": "the feed-forward half reads RMSNorm(x), the block's input, where RMSNorm(h) belongs (a "
                        "parallel block's wiring in a sequential one)",
    "block-ffn-residual-from-normalised": "the feed-forward residual adds the normalised h: y = RMSNorm(h) + FFN, not "
                                          "h + FFN",
    "block-no-rope": "RoPE is not applied (Q and K unrotated)",
    "block-norm2-gamma1": "the second RMSNorm uses gamma1 (gamma2 unused: a copy-paste)",
    "block-mask-not-passed": "the mask is not passed to the attention inside the block (every key visible: SDPA "
                             "called without attn_mask or is_causal)",
}
#: <G_W, W> = sum(G * SwiGLU) is bounded by the rounding of the terms of the right side only, while the
#: left side sums G_W, which the backward forms through SwiGLU's two branches: the invariants' ulps are
#: allowed this many times over for that extra rounding.
EULER_MARGIN = 16


class Block:
    def __init__(self, sc):
        self.visible, self.hidden = sc.visible, ~sc.visible
        self.kv_map = np.asarray(sc.kv_map, dtype=np.intp)
        self.heads_q, self.heads_kv, self.scale = sc.heads_q, sc.heads_kv, sc.scale
        self.eps, self.layout = sc.p("norm_eps"), sc.p("rope_layout")
        self.theta = rope.angles(sc.n_q, sc.p("rotary_dim") or sc.d_head, sc.p("rope_base"))

    def attention_in(self, h1, w_q, w_k, w_v):
        q = rope.forward(split(h1 @ w_q, self.heads_q), self.theta, self.layout)
        k = rope.forward(split(h1 @ w_k, self.heads_kv), self.theta, self.layout)
        return q, k, split(h1 @ w_v, self.heads_kv)

    def forward(self, x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, faults: Collection[str] = (), parts=False):
        h1 = rmsnorm.forward(x, gamma1, self.eps)
        q, k, v = self.attention_in(h1, w_q, w_k, w_v)
        o = attention.forward(q, k, v, self.visible, self.scale, self.kv_map, faults, self.hidden)
        h = x + merge(o) @ w_o
        f = swiglu.forward(rmsnorm.forward(h, gamma2, self.eps), w1, w3, w2)
        return (h + f, f) if parts else h + f

    def wrong_forward(self, mistake: str, x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible=None):
        """The forward with one of its known mistakes (``FORWARD_MISTAKES``), or with another ``visible`` set."""
        if mistake == "block-post-norm":  # norm(x + sublayer(x)) for both sublayers
            q, k, v = self.attention_in(x, w_q, w_k, w_v)
            o = attention.forward(q, k, v, self.visible, self.scale, self.kv_map, (), self.hidden)
            h = rmsnorm.forward(x + merge(o) @ w_o, gamma1, self.eps)
            return rmsnorm.forward(h + swiglu.forward(h, w1, w3, w2), gamma2, self.eps)
        h1 = rmsnorm.forward(x, gamma1, self.eps)
        q, k, v = self.attention_in(h1, w_q, w_k, w_v)
        if mistake == "block-rope-on-v":
            if v.shape[-1] != q.shape[-1]:
                raise ValueError("d_value differs from d_head")
            v = rope.forward(v, self.theta, self.layout)
        if mistake in ("block-no-rope", "block-rope-k-only"):
            q = split(h1 @ w_q, self.heads_q)
        if mistake in ("block-no-rope", "block-rope-q-only"):
            k = split(h1 @ w_k, self.heads_kv)
        visible = np.ones_like(self.visible) if mistake == "block-mask-not-passed" else (
            self.visible if visible is None else visible)
        o = attention.forward(q, k, v, visible, self.scale, self.kv_map, (), ~visible)
        attn = merge(o) @ w_o
        h = attn if mistake == "block-attention-residual-missing-forward" else (
            h1 if mistake == "block-residual-from-normalised" else x) + attn
        h2 = rmsnorm.forward(x if mistake == "block-ffn-from-x" else h,
                             gamma1 if mistake == "block-norm2-gamma1" else gamma2, self.eps)
        f = swiglu.forward(h2, w1, w3, w2)
        if mistake == "block-ffn-residual-from-normalised":
            return h2 + f
        return f if mistake == "block-ffn-residual-missing-forward" else h + f

    def backward(self, x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, grad_y, faults: Collection[str] = (),
                 visible=None):
        shown = self.visible if visible is None else visible
        h1 = rmsnorm.forward(x, gamma1, self.eps)
        q, k, v = self.attention_in(h1, w_q, w_k, w_v)
        o = attention.forward(q, k, v, shown, self.scale, self.kv_map, faults, ~shown)
        merged = merge(o)
        h = x + merged @ w_o
        h2 = rmsnorm.forward(h, gamma2, self.eps)
        # y = h + SwiGLU(h2): the residual passes G_y straight to h
        ffn = swiglu.backward(h2, w1, w3, w2, grad_y, faults)
        g_h2_h, g_gamma2 = rmsnorm.backward(h, gamma2, self.eps, ffn["x"], faults)
        if "block-norm2-backward-gamma1" in faults:
            g_h2_h = rmsnorm.backward(h, gamma1, self.eps, ffn["x"], faults)[0]
        g_h = grad_y if "block-ffn-input-detached" in faults else (
            g_h2_h if "block-ffn-residual-missing" in faults else grad_y + g_h2_h)
        # h = x + merge(O) W_O: the residual passes G_h straight to x
        g_wo = merged.reshape(-1, merged.shape[-1]).T @ g_h.reshape(-1, g_h.shape[-1])
        g_o = split(g_h @ w_o.T, self.heads_q, faults)
        att = attention.backward(q, k, v, shown, self.scale, self.kv_map, g_o, faults)
        unrotated = ("rope-backward-identity",)
        g_q = merge(rope.backward(att.q, self.theta, self.layout, (*faults, *unrotated) if
                                  "block-q-rope-backward-identity" in faults else faults), faults)
        g_k = merge(rope.backward(att.k, self.theta, self.layout, (*faults, *unrotated) if
                                  "block-k-rope-backward-identity" in faults else faults), faults)
        g_q = g_q * 0 if "block-q-rope-detached" in faults else g_q
        g_k = g_k * 0 if "block-k-rope-detached" in faults else g_k
        g_v = merge(att.v, faults)
        rows = h1.reshape(-1, h1.shape[-1]).T
        g_h1 = g_q @ w_q.T
        if "shared-input-sum" not in faults:
            g_h1 = g_h1 + g_k @ w_k.T + g_v @ w_v.T
        g_x_norm, g_gamma1 = rmsnorm.backward(x, gamma1, self.eps, g_h1, faults)
        g_x = g_h if "block-attention-input-detached" in faults else (
            g_x_norm if "block-attention-residual-missing" in faults else g_h + g_x_norm)
        return {"x": g_x, "gamma1": g_gamma1,
                "w_q": rows @ g_q.reshape(-1, g_q.shape[-1]), "w_k": rows @ g_k.reshape(-1, g_k.shape[-1]),
                "w_v": rows @ g_v.reshape(-1, g_v.shape[-1]), "w_o": g_wo, "gamma2": g_gamma2,
                "w1": ffn["w1"], "w3": ffn["w3"], "w2": ffn["w2"]}

    def terms(self, x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, grad_y) -> dict[str, np.ndarray]:
        """The size of the terms of y and of every gradient (float64), composed from the parts' own (RMSNorm's,
        attention's, RoPE's, SwiGLU's term sizes), in the backward's order: a gradient that cancels to nothing
        (W_Q and W_K with one key per query, a one-feature RMSNorm) is judged by what it is made of."""
        x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, grad_y = (
            np.asarray(t, dtype=np.float64) for t in (x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, grad_y))
        cos, sin = np.cos(self.theta), np.sin(self.theta)
        h1 = rmsnorm.forward(x, gamma1, self.eps)
        q, k, v = self.attention_in(h1, w_q, w_k, w_v)
        a = attention.attention_weights(q, k, self.visible, self.scale, self.kv_map)
        o = attention.forward(q, k, v, self.visible, self.scale, self.kv_map)
        h = x + merge(o) @ w_o
        h2 = rmsnorm.forward(h, gamma2, self.eps)
        ffn = swiglu._terms(h2, w1, w3, w2, grad_y)
        norm2 = rmsnorm._terms(h, gamma2, self.eps, ffn["x"])
        t_gh = np.abs(grad_y) + norm2["x"]
        att = attention.term_sizes({"q": q, "k": k, "v": v}, split(t_gh @ np.abs(w_o).T, self.heads_q),
                                   lambda span: a[..., span, :], self.scale, self.kv_map)
        t_q = merge(rope._rotation_terms(att["q"], cos, sin, self.layout))
        t_k = merge(rope._rotation_terms(att["k"], cos, sin, self.layout))
        t_v, t_o = merge(att["v"]), merge(att["o"])
        t_h1 = t_q @ np.abs(w_q).T + t_k @ np.abs(w_k).T + t_v @ np.abs(w_v).T
        norm1 = rmsnorm._terms(x, gamma1, self.eps, t_h1)
        rows = np.abs(h1).reshape(-1, h1.shape[-1]).T
        flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
        return {"o": np.abs(x) + t_o @ np.abs(w_o) + ffn["o"], "x": t_gh + norm1["x"], "gamma1": norm1["gamma"],
                "w_q": rows @ flat(t_q), "w_k": rows @ flat(t_k), "w_v": rows @ flat(t_v),
                "w_o": flat(t_o).T @ flat(t_gh), "gamma2": norm2["gamma"], "w1": ffn["w1"], "w3": ffn["w3"],
                "w2": ffn["w2"]}


def _shapes(sc) -> dict:
    d, f, dh, dv = sc.p("d_model"), sc.p("d_ff"), sc.d_head, sc.d_value
    return {"x": (sc.batch, sc.n_q, d), "gamma1": (d,), "w_q": (d, sc.heads_q * dh), "w_k": (d, sc.heads_kv * dh),
            "w_v": (d, sc.heads_kv * dv), "w_o": (sc.heads_q * dv, d), "gamma2": (d,), "w1": (d, f), "w3": (d, f),
            "w2": (f, d)}


def _data(sc) -> tuple[dict, np.ndarray]:
    """The seeded inputs (gammas near 1) and the upstream gradient g (zero outside ``loss_rows``)."""
    shapes = _shapes(sc)
    d, f = sc.p("d_model"), sc.p("d_ff")
    fan_in = {"w_q": d, "w_k": d, "w_v": d, "w_o": sc.heads_q * sc.d_value, "w1": d, "w3": d, "w2": f}
    data = dense.seeded(sc, {**shapes, "g": shapes["x"]}, {w: n ** -0.5 for w, n in fan_in.items()})
    g = data.pop("g")
    if sc.loss_rows is not None:
        keep = np.zeros(sc.n_q, dtype=bool)
        keep[list(sc.loss_rows)] = True
        g[..., ~keep, :] = 0
    for gamma in ("gamma1", "gamma2"):
        data[gamma] = (1.0 + 0.5 * data[gamma]).astype(data[gamma].dtype)
    return data, g


_STRUCTURE = {"x": Structure(("batch", "row", "feature"), heat=("row", "feature")), "gamma1": Structure(("feature",)),
              "gamma2": Structure(("feature",)), **{w: Structure(("d_in", "d_out")) for w in WEIGHTS}}


def build(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    data, g = _data(sc)
    d, f = sc.p("d_model"), sc.p("d_ff")
    block = Block(sc)
    grads = block.backward(**data, grad_y=g, faults=faults)
    y, ffn_out = block.forward(**data, faults=faults, parts=True)

    def fwd(**t):
        return block.forward(**t, faults=faults)

    def checks() -> list:
        out = projections.mask_invariants(sc, "x", data, lambda t: block.forward(**t, faults=faults),
                                          lambda t, go: block.backward(**t, grad_y=go, faults=faults))
        # y = h + SwiGLU(h2) is affine in W_3 and in W_2: <G_W, W> = sum(G_y * SwiGLU(h2)) (Euler)
        target = float(np.sum(ffn_out.astype(np.float64) * g))
        size = float(np.sum(np.abs(ffn_out.astype(np.float64) * g)))
        eps = float(np.finfo(np.dtype(sc.dtype)).eps)
        for w in ("w3", "w2"):
            value = float(np.sum(grads[w].astype(np.float64) * data[w]))
            out.append(invariants.bounded(f"<G_{w.upper()}, {w.upper()}> = sum(G * SwiGLU)", f"g_{w}",
                                          np.asarray([value - target]),
                                          INVARIANT_ULPS * eps * max(size, 1.0) * EULER_MARGIN,
                                          f"the block is affine in {w.upper()}: {value:.9g} against {target:.9g}"))
        return out

    magnitude = (np.abs(data["x"]).astype(np.float64) + np.abs(y) + np.abs(ffn_out)) * (4 + sc.n_q)
    lift = {**{w: 1 for w in WEIGHTS}, "gamma1": 2, "gamma2": 2}
    return dense.problem(
        sc, data, fwd, grads, g, lift=lift, magnitude=magnitude, invariants=checks,
        work_factor=6.0 * sc.heads_q * sc.n_q / d + 4.0 * f / d + 8, structure=_STRUCTURE,
        arrays={"visible": sc.visible, "scale": np.asarray(sc.scale), "kv_map": block.kv_map, "angles": block.theta})


def build_user(sc, faults: Collection[str] = (), sizes: dict[str, float] | None = None):
    """A user's implementation, through the shared engine (``user_engine``): f(x, gamma1, w_q, w_k, w_v, w_o,
    gamma2, w1, w3, w2, visible, cos, sin, scale, kv_map, eps), every parameter's gradient checked like x's.
    The mask invariants run on it; the Euler identities of the built-in engine need SwiGLU's output inside
    the block, which a black box does not show."""
    data, g = _data(sc)
    block = Block(sc)
    order = tuple(data)
    args = {"visible": sc.visible, "cos": np.cos(block.theta).astype(sc.dtype),
            "sin": np.sin(block.theta).astype(sc.dtype), "scale": sc.scale, "kv_map": block.kv_map,
            "eps": block.eps}

    def forward(*values):
        return block.forward(*values[:len(order)])

    def backward(*values):  # (*inputs, *args, grad_y, faults): args start with the visible set
        grads = block.backward(*values[:len(order)], grad_y=values[-2], faults=values[-1], visible=values[len(order)])
        return tuple(grads[t] for t in order)

    return user_engine.build(sc, user_engine.UserOp(
        inputs=data, args=args, g=g, forward=forward, backward=backward,
        terms=lambda inputs, a, g: block.terms(**inputs, grad_y=g),
        invariants=lambda calls, dtype, y: projections.mask_invariants(sc, "x", data, calls.forward, calls.backward,
                                                                        dtype),
        batched=("x", "visible"), structure=_STRUCTURE, shown=projections.SHOWN,
        forward_mistakes={**{name: (says, lambda *v, name=name: block.wrong_forward(name, *v[:len(order)]))
                             for name, says in FORWARD_MISTAKES.items()
                             if name != "block-mask-not-passed" or not sc.visible.all()},
                          **{name: (says, lambda *v, shown=shown: block.wrong_forward("", *v[:len(order)],
                                                                                      visible=shown))
                             for name, says, shown in mask_variants(sc, "forward")}},
        alternatives=projections.kv_alternatives(sc, lambda kv: Block(dataclasses.replace(sc, kv_map=kv)).forward(
            *(v.astype(np.float64) for v in data.values()))), mistakes=user_engine.mistakes(FAULTS, MISTAKES)), faults)


def _validate(params: dict, att: dict) -> list:
    if att["n_k"] != att["n_q"]:
        return [("n_k", f"a block is self-attention: n_k must equal n_q={att['n_q']} (got {att['n_k']})", None)]
    r = params["rotary_dim"] or att["d_head"]
    if r > att["d_head"]:
        return [("rotary_dim", f"{r} is larger than d_head={att['d_head']}", "use at most d_head")]
    if r % 2:
        return [("rotary_dim" if params["rotary_dim"] else "d_head",
                 f"the rotary dimension must be even (pairs of features), got {r}", None)]
    return []



def _memory(sc) -> int:
    """Attention's estimate plus the projections' weights and activations."""
    return attention_memory.need(sc) + dense.tensor_need(_shapes(sc))


#: A small scenario on which every fault of this op applies (the fault contract's).
EXAMPLE = {"batch": 2, "n_q": 6, "d_model": 12, "d_ff": 16, "d_head": 4, "heads_q": 4, "heads_kv": 2,
           "mask": {"causal": "lower-right"}}

#: What a user's implementation provides (``implementation:``).
INTERFACE = Interface(("numpy", "torch", "jax"), (
    "numpy: an object with forward(x, gamma1, w_q, w_k, w_v, w_o, gamma2, w1, w3, w2, visible, cos, sin, scale, "
    "kv_map, eps) -> y and backward(same arguments, grad_y) -> (dx, dgamma1, dw_q, dw_k, dw_v, dw_o, dgamma2, "
    "dw1, dw3, dw2); torch: a callable f(same arguments) -> y, differentiated by autograd; jax: the same "
    "function on JAX arrays, differentiated by jax.vjp; x [B, n, d_model], weights [in, out], heads split as "
    "[B, n, H*d] -> [B, H, n, d], RoPE on Q and K with cos/sin [n, rotary_dim / 2] (pairs as rope_layout says), "
    "visible [B, Hq, n, n] (True = key visible), kv_map[h] the KV head of query head h, eps the RMSNorm eps"),
    args=("visible", "cos", "sin", "scale", "kv_map", "eps"), conventions=("mask", "mask_heads"))

#: The space ``attn-gradcheck hunt`` searches: attention's (self-attention: n_k is n_q), the model and hidden widths.
SPACE = tuple(a for a in ATTENTION_AXES if a.key != "n_k") + (Axis("d_model", low=1, high=256, edges=HEAD_EDGES),
                          Axis("d_ff", low=1, high=512, edges=WIDTHS))

OP = Op(name="block", summary="pre-norm transformer block (RMSNorm, RoPE attention with projections, SwiGLU, "
                              "residuals): gradients of x and every parameter",
        tensors=("x", "gamma1") + WEIGHTS[:4] + ("gamma2",) + WEIGHTS[4:], faults=FAULTS,
        **user_code_engines("gradcheck_cli.ops.block"),
        backends=("numpy", "torch", "jax"), implementation=INTERFACE,
        shared_keys=attention.scenario_keys.KEY_GROUP,
        keys={"d_model": Param("int", help="model width, e.g. 'd_model: 16'"),
              "d_ff": Param("int", help="SwiGLU hidden width, e.g. 'd_ff: 32'"),
              "norm_eps": Param("float", 1e-6, "RMSNorm eps", minimum=0.0),
              "rope_base": Param("float", 10000.0, "RoPE base"),
              "rotary_dim": Param("int", None, "features rotated (even; default d_head)"),
              "rope_layout": Param("choice", "half", "half or interleaved", choices=rope.LAYOUTS)},
        validate=_validate, shapes=_shapes, memory=_memory,
        describe=lambda sc: f"B={sc.batch} n={sc.n_q} d_model={sc.p('d_model')} d_ff={sc.p('d_ff')} Hq={sc.heads_q} "
                            f"Hkv={sc.heads_kv} d={sc.d_head}/{sc.d_value} {sc.dtype} {sc.mode}",
        example=EXAMPLE, space=SPACE)
