"""Memory: what this process may still use (MemAvailable, the cgroup's limit, the address-space
rlimit) and what a scenario needs before anything of its size is allocated."""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np


def cgroup_room(root: str | os.PathLike = "/sys/fs/cgroup") -> list[int]:
    """Bytes left under the cgroup's memory limit: v2's memory.max - memory.current, v1's
    memory/memory.limit_in_bytes - memory/memory.usage_in_bytes (each where it is set)."""
    root = Path(root)
    out = []
    for cap_file, used_file in (("memory.max", "memory.current"),
                                ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (root / cap_file).read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes "no limit" as a number near 2^63
                out.append(int(cap) - int((root / used_file).read_text()))
        except (OSError, ValueError):
            pass
    return out


def available_memory() -> int:
    """Bytes this process may still use: the least of MemAvailable, the cgroup's limit minus what the
    cgroup uses (cgroup v2's memory.max, or v1's memory.limit_in_bytes), and the address-space rlimit
    (where each is known)."""
    limits = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limits += cgroup_room()
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            limits.append(soft)
    except (ImportError, OSError, ValueError):
        pass
    return max(0, min(limits))


def attention_need(batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, dtype, engine="naive", block_q=64,
                   block_k=64) -> int:
    """Bytes attention needs before anything of size n_q x n_k is allocated: about ten score-sized
    arrays for the naive engine's forward, backward and invariants plus one (+h, -h) pair of copies
    (see numeric.plan); for the tiled engine only the visible set (bytes) and block-sized scores. The
    tensors (q, k, v, o and their gradients, analytic and numeric) count about a dozen times."""
    itemsize = {"float16": 2, "bfloat16": 2}.get(dtype) or np.dtype(dtype).itemsize
    scores = batch * heads_q * n_q * n_k
    tensors = batch * (heads_q * n_q * (d_head + d_value) + heads_kv * n_k * (d_head + d_value))
    if engine == "tiled":
        return (scores * 2 + batch * heads_q * min(block_q, n_q) * min(block_k, n_k) * 16 * itemsize
                + batch * heads_q * 256 * n_k * 3 * 8 + tensors * 12 * 8)
    return scores * (16 * itemsize + 2) + tensors * 12 * 8


def _plain_need(spec, sc) -> int:
    """Bytes an op without attention's estimate needs: its tensors about 64 times over (inputs,
    gradients, copies, the wider-type forward) and what it declares beyond them."""
    elements = sum(math.prod(shape) for shape in spec.shapes(sc).values())
    return elements * 64 * 8 + (spec.memory(sc) if spec.memory else 0)


class _Probe:
    """Enough of a Scenario for ``Op.shapes`` before the Scenario exists (attention-keyed ops)."""

    def __init__(self, batch, heads_q, heads_kv, n_q, n_k, d_head, d_value, params: dict):
        self.batch, self.heads_q, self.heads_kv, self.n_q, self.n_k = batch, heads_q, heads_kv, n_q, n_k
        self.d_head, self.d_value = d_head, d_value
        self._params = params

    def p(self, key: str):
        return self._params[key]

