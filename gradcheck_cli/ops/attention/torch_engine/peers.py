"""The plain computations in torch that a result is judged against (``precision.judge``'s ``plain``): autograd
of the plain forward in a precision, and in half precision also the closed forms without faults and SDPA, so
that no one plain way is lucky (torch's softmax backward rounds less than the closed forms' steps: either alone
would judge the other; SDPA has no score stages). Used by the torch engine and for a user's torch code."""
from __future__ import annotations

import numpy as np
import torch

from .. import stages as score_stages
from ..args import Args
from .formulas import DTYPES, backward, by_autograd, forward, forward_softmax, sdpa

LOW_PRECISION = ("float16", "bfloat16")


def plain(inputs: dict, g: np.ndarray, args: Args, heads_q: int, device, precision: str) -> dict | list[dict]:
    """The plain ways in ``precision`` on ``inputs`` (q, k, v and a checked stage parameter, float64 arrays
    holding the values the dtype holds) and upstream gradient ``g``: one dict of O and gradients by name, or in
    half precision a list of them. ``args``: NumPy arrays (the visible set the implementation must honour)."""
    pdt = DTYPES[precision]
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=pdt)  # noqa: E731
    np_ = lambda t: t.detach().to("cpu", torch.float64).numpy().copy()  # noqa: E731
    extra = [t for t in inputs if t not in ("q", "k", "v")]
    names = ("q", "k", "v", *extra)
    mask = torch.from_numpy(np.asarray(args.visible)).to(device)
    kv_map = torch.as_tensor(np.asarray(args.kv_map), dtype=torch.long, device=device)
    right = Args(mask, args.scale, kv_map, args.stages)
    leaves, gp = [to(inputs[t]) for t in names], to(g)

    def plain_forward(q_, k_, v_, *ps):  # a stage parameter's values as a leaf of autograd too
        at = args.stages
        for t, p in zip(extra, ps):
            at = score_stages.moved(at, t, p)
        return forward(q_, k_, v_, **right.but(stages=at).kw)

    out, gr = by_autograd(plain_forward, leaves, gp)
    ways = [{"o": np_(out), **{t: np_(x) for t, x in zip(names, gr)}}]
    if precision not in LOW_PRECISION:
        return ways[0]
    qkv = leaves[:3]
    closed = backward(*qkv, grad_o=gp, **right.kw)
    ways.append({"o": np_(forward(*qkv, **right.kw)), **{t: np_(x) for t, x in zip("qkv", closed)}})
    if args.stages:  # SDPA has no score stages: torch.softmax's own kernel and backward are the library way then
        soft_o, soft = by_autograd(lambda q_, k_, v_: forward_softmax(q_, k_, v_, **right.kw), qkv, gp)
        return ways + [{"o": np_(soft_o), **{t: np_(x) for t, x in zip("qkv", soft)}}]
    sd_o, sd = by_autograd(lambda q_, k_, v_: sdpa(q_, k_, v_, mask, args.scale, kv_map, heads_q), qkv, gp)
    return ways + [{"o": np_(sd_o), **{t: np_(x) for t, x in zip("qkv", sd)}}]
