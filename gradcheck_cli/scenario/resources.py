"""Memory: what this process may still use (MemAvailable, the cgroup's limit, the address-space
rlimit) and what a scenario needs before anything of its size is allocated."""
from __future__ import annotations

import os
from pathlib import Path

from ..ops.dense import tensor_need


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


def need(spec, sc) -> int:
    """Bytes scenario ``sc`` (or a probe of it) of op ``spec`` needs: the op's own estimate (``Op.memory``),
    or its tensors' (``dense.tensor_need``)."""
    return spec.memory(sc) if spec.memory else tensor_need(spec.shapes(sc))


class _Probe:
    """Enough of a Scenario for ``Op.shapes`` and ``Op.memory`` before the Scenario exists (the ops with a key
    group, ``Op.shared_keys``): the fields their keys read, its params, dtype and engine."""

    def __init__(self, params: dict, dtype: str = "float64", engine: str = "naive", block_q: int = 64,
                 block_k: int = 64, **fields):
        self.dtype, self.engine, self.block_q, self.block_k = dtype, engine, block_q, block_k
        self.__dict__.update(fields)
        self._params = params

    def p(self, key: str):
        return self._params[key]
