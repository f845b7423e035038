"""The one process of a context-parallel check of JAX code (started by :class:`.ranks.Ranks` with
``XLA_FLAGS=--xla_force_host_platform_device_count=world_size``): a mesh of ``world_size`` devices on one axis,
``cp``, and the user's per-shard function run under ``jax.shard_map`` over it, jitted. A call carries the global
arrays with their rows already in rank order (rank r's shard is the r-th contiguous block: the zigzag layout is a
permutation), and is one forward, or one ``jax.vjp`` of the sharded function on ``<G, O> (+ <G_L, LSE>)``.
Arguments that are arrays (the sinks, ALiBi slopes) are replicated on every device (``P()``); JAX sums their
cotangents over the devices itself. The answers are NumPy arrays; whatever the code raises goes back as text."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .rank import check_shape, serve
from .sharding import lse_shape

AXIS = "cp"
ON_SHARD = "on each shard"


def _start(config: dict) -> dict:
    import jax
    from jax.sharding import Mesh

    from gradcheck_cli import implementation
    devices = jax.devices()
    ws = config["world_size"]
    if len(devices) < ws:
        raise RuntimeError(f"JAX sees {len(devices)} device(s), world_size is {ws}")
    return {"fn": implementation.load(config["spec"], Path(config["base_dir"]), flavour="jax"),
            "mesh": Mesh(np.array(devices[:ws]), (AXIS,)), "cache": {}}


def _spec(ndim: int, axis: int):
    from jax.sharding import PartitionSpec as P
    return P(*[AXIS if i == axis else None for i in range(ndim)])


def _compiled(state: dict, call: dict, arrays: tuple[str, ...], static: dict):
    """(the sharded forward, its VJP) for this call's settings, jitted once."""
    import jax
    from jax.sharding import PartitionSpec as P
    want_lse = bool(call["return_lse"])
    key = (arrays, tuple(sorted((k, repr(v)) for k, v in static.items())), want_lse, call["axis"], call["lse_axis"])
    if key in state["cache"]:
        return state["cache"][key]
    fn = state["fn"]

    def local(q, k, v, positions, *values):
        out = fn(q, k, v, axis_name=AXIS, q_positions=positions, k_positions=positions, **static,
                 **dict(zip(arrays, values)), **({"return_lse": True} if want_lse else {}))
        o_shape = list(q.shape)
        o_shape[-1] = v.shape[-1]
        if want_lse:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise TypeError(f"with return_lse=True the code returns (o, lse), got {type(out).__name__}")
            check_shape("o", out[0], o_shape, ON_SHARD)
            check_shape("lse", out[1], lse_shape(q.shape, call["axis"], call["lse_axis"]), ON_SHARD)
            return tuple(out)
        if isinstance(out, (tuple, list)) or out is None:
            got = "None" if out is None else f"a {type(out).__name__} of {len(out)}"
            raise TypeError(f"the code returns o (an array), got {got}")
        check_shape("o", out, o_shape, ON_SHARD)
        return out

    seq = _spec(4, call["axis"])
    out_specs = (seq, _spec(3, call["lse_axis"])) if want_lse else seq
    sharded = jax.shard_map(local, mesh=state["mesh"], in_specs=(seq, seq, seq, P(AXIS)) + (P(),) * len(arrays),
                            out_specs=out_specs)

    def vjp(primals, cotangent):  # the positions closed over: no cotangent for integers
        q, k, v, positions, *values = primals
        return jax.vjp(lambda q, k, v, *values: sharded(q, k, v, positions, *values), q, k, v, *values)[1](cotangent)

    state["cache"][key] = jax.jit(sharded), jax.jit(vjp)
    return state["cache"][key]


def _run(state: dict, call: dict) -> dict:
    kwargs = call["kwargs"]
    arrays = tuple(sorted(k for k, v in kwargs.items() if isinstance(v, np.ndarray)))
    static = {k: (tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items() if k not in arrays}
    forward, vjp = _compiled(state, call, arrays, static)
    primals = (call["q"], call["k"], call["v"], call["positions"]) + tuple(kwargs[a] for a in arrays)
    want_lse = bool(call["return_lse"])
    if not call["backward"]:
        out = forward(*primals)
        o, lse = out if want_lse else (out, None)
        return {"o": np.asarray(o), **({"lse": np.asarray(lse)} if want_lse else {})}
    cotangent = (call["grad_o"], call["grad_lse"]) if want_lse else call["grad_o"]
    grads = vjp(primals, cotangent)
    out = {n: np.asarray(g) for n, g in zip(["q", "k", "v", *arrays], grads)}
    out["no_gradient"] = []
    return out


def main(fd: int) -> None:
    serve(fd, _start, _run)


if __name__ == "__main__":
    main(int(sys.argv[1]))
