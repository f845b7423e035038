"""One rank of a context-parallel check (started by :class:`.ranks.Ranks`): join the
process group, load the per-rank function, then answer calls until told to stop. A call is one forward, or one
forward and backward by autograd on the local loss ``<G, O_local> (+ <G_L, LSE_local>)``; the answer is NumPy arrays.
Whatever the code raises is sent back as text (the tool stops every rank)."""
from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection

from .wire import unpack


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "gradcheck_cli" not in f.filename]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    lines = str(exc).strip().splitlines() or [""]
    more = " (...)" if len(lines) > 1 else ""  # JAX's errors run to pages: their first line says what
    return f"{type(exc).__name__}: {lines[0]}{more}{where}"


def check_shape(name: str, x, shape, where: str):
    """``x`` when the code's output ``name`` has the shard's ``shape``; a ValueError naming both otherwise."""
    got = list(getattr(x, "shape", ()))
    if got != list(shape):
        raise ValueError(f"the code returned {name} of shape {got} {where}, expected {list(shape)}")
    return x


def _start(config: dict):
    import datetime

    import torch
    import torch.distributed as dist

    from gradcheck_cli import implementation, numeric
    torch.set_num_threads(1)
    numeric.keep_freed_memory()  # the calls allocate the same few sizes again and again: no page fault for each
    store = dist.FileStore(config["store"], config["world_size"])
    dist.init_process_group(config["backend"], store=store, rank=config["rank"], world_size=config["world_size"],
                            timeout=datetime.timedelta(seconds=config["timeout"]))
    from pathlib import Path
    fn = implementation.load(config["spec"], Path(config["base_dir"]), flavour="torch")
    return fn, dist.group.WORLD


def _run(fn, group, call: dict, device: str) -> dict:
    """One call: the forward (``call["backward"]`` False) or the forward and the gradients of the local loss."""
    import numpy as np
    import torch

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    q, k, v = (t(call[name]) for name in ("q", "k", "v"))
    kw = {name: t(x) if isinstance(x, np.ndarray) else x for name, x in call["kwargs"].items()}
    want_lse = bool(call.get("return_lse"))
    if want_lse:
        kw["return_lse"] = True
    params = list(call.get("params", ()))  # replicated parameters whose gradients are taken (sinks=, ...)

    o_shape = list(q.shape)
    o_shape[-1] = v.shape[-1]

    def shaped(name, x, shape):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"the code returns {name} as a torch.Tensor, got {type(x).__name__}")
        return check_shape(name, x, shape, "on this rank")

    def split(out):
        if want_lse:
            if not isinstance(out, (tuple, list)) or len(out) != 2:
                raise TypeError(f"with return_lse=True the code returns (o, lse), got {type(out).__name__}")
            return shaped("o", out[0], o_shape), shaped("lse", out[1], call["lse_shape"])
        return shaped("o", out, o_shape), None

    if not call["backward"]:
        with torch.no_grad():
            o, lse = split(fn(q, k, v, group=group, **kw))
        return {"o": o.detach().cpu().numpy(), **({"lse": lse.detach().cpu().numpy()} if want_lse else {})}
    leaves = [x.requires_grad_(True) for x in (q, k, v)] + [kw[p].requires_grad_(True) for p in params]
    with torch.enable_grad():
        o, lse = split(fn(q, k, v, group=group, **kw))
        loss = (o * t(call["grad_o"])).sum()
        if want_lse:
            loss = loss + (lse * t(call["grad_lse"])).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else [None] * len(leaves)
    names = ["q", "k", "v"] + params
    out = {n: (torch.zeros_like(x) if g is None else g).detach().cpu().numpy()
           for n, x, g in zip(names, leaves, grads)}
    out["no_gradient"] = [n for n, g in zip(names, grads) if g is None]
    return out


def serve(fd: int, start, run) -> bool:
    """Answer the tool on connection ``fd``: the first message is the configuration (``start(config)`` -> state),
    each later one a call (``run(state, call)`` -> answer), None the end. Whatever raises goes back as text.
    False when the tool went away."""
    conn = Connection(fd)
    state = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return False
        if message is None:
            return True
        try:
            if state is None:
                state = start(message)
                conn.send(("ok", None))
                continue
            conn.send(("ok", run(state, unpack(message))))
        except BaseException as exc:  # noqa: BLE001 -- whatever the code raises goes back to the tool as text
            conn.send(("error", _describe(exc)))


def main(fd: int, rank: int) -> None:
    def start(config):
        return (*_start({**config, "rank": rank}), config["device"])

    if not serve(fd, start, lambda state, call: _run(state[0], state[1], call, state[2])):
        return
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 -- leaving anyway
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
