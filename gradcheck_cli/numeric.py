"""Central differences of a scalar loss, batched: perturbed copies are stacked on a leading axis and
evaluated in one vectorised call per chunk, each chunk bounded by a memory budget.

``loss(x)`` takes ``x`` with extra leading copy axes and returns L per copy.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import functools
import itertools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from threadpoolctl import ThreadpoolController

Loss = Callable[[np.ndarray], np.ndarray]
Progress = Callable[[int], None]


class SeedStream(enum.IntEnum):
    """The random streams of a scenario: each use draws from ``np.random.default_rng([sc.seed, stream])``
    of its own, so drawing more in one never moves another's draws (nor the reports). Attention's
    inputs draw from the bare seed, ``default_rng(sc.seed)``; the directions of directional mode from
    ``[direction_seed, index]`` (``unit_direction``)."""
    INPUTS = 0          # the inputs and upstream gradient of the ops built on ``dense.seeded``
    INVARIANTS = 1      # what the invariants move, and their upstream gradients (every engine, projections)
    DIFFERENCES = 2     # the elements and directions a gradient check samples, and its probes
    INDEPENDENCE = 3    # the moves of colouring's independence test
    FAST_FORWARD = 4    # the moved copies the fast forward is compared with the reference on
    INFONCE_WEIGHTS = 5  # infonce's per-query weights of the loss (its upstream gradient)
    LOGIT_SCALE = 7     # logit-scale's draws of q and k
    STEP_SWEEP = 9      # the elements ``sweep-eps`` differences
    BATCH_MIXING = 11   # the moved batch elements of the hints' batch-mixing test
    TANGENT_HINTS = 12  # the tangent the JVP hints compare an output tangent with the closed form's mistakes on
    PRECISION = 13      # the direction the precision diagnosis moves the inputs along (``precision.nearby``)
    STAGES = 14         # the score stages' seeded parameters (an additive bias's values)
    LSE = 15            # the upstream gradient of attention's log-sum-exp, when it is an output (outputs: [o, lse])
    DROPOUT = 16        # attention's dropout keep mask (dropout: {p})


def quiet_numpy_arithmetic() -> None:
    """NumPy's overflow/invalid-value warnings raised inside NumPy's own functions while the checks
    judge values near the float64 limit: the verdict says what is wrong; the warnings only add noise
    (this package's own lines are silenced in its __init__; the user's code keeps its warnings)."""
    import warnings
    warnings.filterwarnings("ignore", category=RuntimeWarning, module=r"numpy(\.|$)")


def step_size(x, epsilon: float, size: float = 1.0):
    """The one step policy: h = epsilon * max(size, |x|). ``size`` is the input's natural scale, below
    which the step stops shrinking with |x| (1 for the standard-normal inputs; |tau| for a temperature,
    whose whole range may be below 1)."""
    return epsilon * np.maximum(size, np.abs(x))


def perturb(x: np.ndarray, epsilon: float, size: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The perturbed values x + h, x - h with h from :func:`step_size`.

    The difference quotient divides by (x + h) - (x - h), the step that was actually taken in
    floating point, not by the nominal 2h.
    """
    h = step_size(x, epsilon, size).astype(x.dtype)
    return x + h, x - h


#: Chunks evaluated concurrently. NumPy's elementwise passes (the softmax) run on one core and
#: release the GIL, so two chunks in flight keep both cores of a small machine busy.
WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Chunking:
    """How finite differences are batched: ``pairs`` (+h, -h) pairs of copies per vectorised call,
    ``workers`` calls in flight at once."""
    pairs: int
    workers: int = 1


def plan(copy_bytes: int, budget_bytes: int, serial: bool = False) -> Chunking:
    """Fit the calls in flight into the memory budget; at least one pair, on one worker, always runs. ``serial``:
    the calls run one at a time anyway (the ranks of a distributed check): one worker, one chunk of the whole
    budget (a second worker only overlapped the tool's share of the work, for half as many copies a call: at
    world size 4, n = 256, 41.2 s with two workers against 35.9 s with one)."""
    pair = 2 * max(1, copy_bytes)
    workers = WORKERS if WORKERS * pair <= budget_bytes and not serial else 1
    return Chunking(pairs=max(1, int(budget_bytes // (workers * pair))), workers=workers)


@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks for reuse rather than hand them back to the OS.

    Every chunk allocates arrays of the same few sizes (copies, scores, outputs). By default glibc
    maps each block over its mmap threshold afresh and unmaps it when freed (a block of exactly the
    threshold's size never stops doing so), so every chunk pays a page fault per 4 KiB touched: in a
    virtual machine that doubled the time per copy (190 vs 95 us at n=128, d=64; M_TRIM_THRESHOLD
    alone or M_MMAP_THRESHOLD alone does not help). Blocks up to 32 MiB now come from the heap, which
    keeps up to 256 MiB free. Process-wide (also inside a host process using the Python API or the
    pytest plugin) and idempotent; a no-op (False) without glibc or with the environment variable
    ATTN_GRADCHECK_KEEP_FREED_MEMORY=0."""
    if os.environ.get("ATTN_GRADCHECK_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 256 * 2**20))


def _in_chunks(work: Callable[[int, int], object], total: int, chunking: Chunking) -> Iterator[tuple[int, int, object]]:
    """Yield (start, stop, work(start, stop)) over [0, total) in order, ``chunking.pairs`` at a time."""
    keep_freed_memory()
    bounds = [(a, min(a + chunking.pairs, total)) for a in range(0, total, chunking.pairs)]
    if chunking.workers == 1 or len(bounds) == 1:
        for a, b in bounds:
            yield a, b, work(a, b)
        return
    # One BLAS thread per worker: the workers already fill the cores, and nested BLAS threads would
    # oversubscribe them.
    with _blas_controller().limit(limits=1, user_api="blas"):
        pool, queue = _pool(chunking.workers), iter(bounds)
        # Only a window of chunks is queued ahead (memory, and a prompt stop on Ctrl-C).
        pending = collections.deque((ab, pool.submit(work, *ab))
                                    for ab in itertools.islice(queue, 2 * chunking.workers))
        try:
            while pending:
                (a, b), future = pending.popleft()
                value = future.result()
                following = next(queue, None)
                if following is not None:
                    pending.append((following, pool.submit(work, *following)))
                yield a, b, value
        finally:  # Ctrl-C (or any error): chunks not yet started never start
            for _, future in pending:
                future.cancel()


#: A scenario whose inputs hold at most this many elements does its own products (the build, the invariants,
#: the probes: everything outside the chunk threads, which always take one BLAS thread each) with one BLAS
#: thread too: its products are too small to share (OpenBLAS splits any above 64^3 multiply-adds, e.g. a
#: 128 x 128 x 64 score matrix), and on a machine whose cores are busy, waking a second BLAS thread per product
#: cost more than the product (n=128, d=64: 0.30 s of main-thread work against 0.05 s on one thread).
SERIAL_BLAS_ELEMENTS = 2**18


def serial_blas(elements: int) -> contextlib.AbstractContextManager:
    """One BLAS thread for the products of a scenario of ``elements`` input elements (SERIAL_BLAS_ELEMENTS),
    while the context lasts; BLAS as it is for a larger one."""
    if elements > SERIAL_BLAS_ELEMENTS:
        return contextlib.nullcontext()
    return _blas_controller().limit(limits=1, user_api="blas")


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    """One long-lived pool per size: starting threads for every tensor costs more than small checks."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attn-gradcheck")


@functools.lru_cache(maxsize=1)
def _blas_controller() -> ThreadpoolController:
    return ThreadpoolController()


def elements(loss: Loss, x: np.ndarray, indices: np.ndarray, epsilon: float, chunking: Chunking,
             progress: Progress | None = None, size: float = 1.0) -> np.ndarray:
    """dL/dx at the given flat indices by central differences: one +h and one -h copy each."""
    flat_x = x.ravel()
    out = np.empty(len(indices), dtype=np.float64)

    def work(start: int, stop: int) -> np.ndarray:
        idx = indices[start:stop]
        c = len(idx)
        copies = np.broadcast_to(x, (2 * c,) + x.shape).copy()
        flat = copies.reshape(2 * c, -1)
        plus, minus = perturb(flat_x[idx], epsilon, size)
        rows = np.arange(c)
        flat[rows, idx] = plus
        flat[c + rows, idx] = minus
        values = np.asarray(loss(copies), dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):  # a step lost to rounding gives inf/nan: a failure
            return (values[:c] - values[c:]) / (plus.astype(np.float64) - minus.astype(np.float64))

    for start, stop, value in _in_chunks(work, len(indices), chunking):
        out[start:stop] = value
        if progress:
            progress(stop - start)
    return out


def colours(part_of: np.ndarray) -> list[np.ndarray]:
    """Split the elements (flat indices) into colour classes with at most one element per block:
    colour c holds the c-th element of every block (blocks given by ``part_of``)."""
    flat = part_of.ravel()
    order = np.argsort(flat, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(flat[order]) != 0])
    sizes = np.diff(np.r_[starts, flat.size])
    rank = np.arange(flat.size) - np.repeat(starts, sizes)
    by_rank = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[by_rank], np.arange(int(sizes.max()) + 1))
    return [order[by_rank[bounds[c]:bounds[c + 1]]] for c in range(len(bounds) - 1)]


def coloured(loss_parts: Callable[[np.ndarray], np.ndarray], x: np.ndarray, part_of: np.ndarray, epsilon: float,
             chunking: Chunking, progress: Progress | None = None) -> np.ndarray:
    """dL/dx for every element, perturbing one element of every independent block at once (a
    Jacobian-sparsity colouring) and reading each derivative from its own block's part of L.
    Valid only when the blocks really are independent: see :func:`leakage`."""
    flat_x, flat_part = x.ravel(), part_of.ravel()
    classes = colours(part_of)
    out = np.empty(x.size, dtype=np.float64)

    def work(start: int, stop: int):
        c = stop - start
        members = np.concatenate(classes[start:stop])
        rows = np.repeat(np.arange(c), [len(m) for m in classes[start:stop]])
        copies = np.broadcast_to(x, (2 * c,) + x.shape).copy()
        flat = copies.reshape(2 * c, -1)
        plus, minus = perturb(flat_x[members], epsilon)
        flat[rows, members] = plus
        flat[c + rows, members] = minus
        values = np.asarray(loss_parts(copies), dtype=np.float64)
        blocks = flat_part[members]
        return members, (values[rows, blocks] - values[c + rows, blocks]) / (
            plus.astype(np.float64) - minus.astype(np.float64))

    for _, _, (members, value) in _in_chunks(work, len(classes), chunking):
        out[members] = value
        if progress:
            progress(len(members))
    return out


def leakage(loss_parts: Callable[[np.ndarray], np.ndarray], x: np.ndarray, part_of: np.ndarray,
            rng: np.random.Generator, chunking: Chunking = Chunking(8)) -> tuple[float, float, int]:
    """(largest change of an unmoved block's part of L, largest |part|, a flat index in the worst
    block): :func:`leakage_by_block` summed up."""
    change, scale = leakage_by_block(loss_parts, x, part_of, rng, chunking)
    worst_block = int(np.argmax(change))
    return float(change.max(initial=0.0)), scale, int(np.flatnonzero(part_of.ravel() == worst_block)[0])


def leakage_by_block(loss_parts: Callable[[np.ndarray], np.ndarray], x: np.ndarray, part_of: np.ndarray,
                     rng: np.random.Generator, chunking: Chunking = Chunking(8)) -> tuple[np.ndarray, float]:
    """Test the independence colouring assumes, for every ordered pair of blocks (p moves, p' must not
    change), with 2 * ceil(log2 P) evaluations: for each bit of the block number, one copy moves the
    blocks whose bit is 1 and another those whose bit is 0 (every element of a moved block by a random
    amount of size max(1, |x|)). Any two blocks differ in some bit, so every p is moved while p' is
    not in some copy. Also, the unmoved copy evaluated among the others must equal the inputs evaluated
    alone (stacked copies must not interact). Returns (the largest change of each block's part of L
    while it stood still [P], the largest |part|); independence means rounding at most."""
    flat_x, flat_part = x.ravel(), part_of.ravel()
    blocks = int(flat_part.max()) + 1
    if blocks == 1:
        return np.zeros(1), 0.0
    bits = int(np.ceil(np.log2(blocks)))
    ids = np.arange(blocks)
    moved = np.array([((ids >> t) & 1) == v for t in range(bits) for v in (0, 1)])   # [2 bits, P]
    moves = (rng.standard_normal(x.size) * np.maximum(1.0, np.abs(flat_x))).astype(x.dtype)
    alone = np.asarray(loss_parts(x[None]), dtype=np.float64)[0]

    def work(start: int, stop: int):
        # copy 0 stays unmoved in the same call: it must equal the inputs evaluated alone (copies
        # stacked together must not interact), and the moved copies are compared with it
        copies = np.broadcast_to(x, (stop - start + 1,) + x.shape).copy()
        copies.reshape(stop - start + 1, -1)[1:] += np.where(moved[start:stop][:, flat_part], moves, 0).astype(x.dtype)
        values = np.asarray(loss_parts(copies), dtype=np.float64)
        change = np.where(moved[start:stop], 0.0, np.abs(values[1:] - values[0]))
        return np.vstack([np.abs(values[0] - alone)[None], change]), float(np.abs(values[0]).max())

    pieces = [piece for _, _, piece in _in_chunks(work, len(moved), Chunking(2 * chunking.pairs))]
    change = np.concatenate([c for c, _ in pieces])
    return change.max(axis=0), max(m for _, m in pieces)


def directions(loss: Loss, x: np.ndarray, grad: np.ndarray, which: np.ndarray, seed: int, epsilon: float,
               chunking: Chunking, progress: Progress | None = None,
               size: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Directional derivatives along the random unit directions numbered ``which`` (direction i is
    ``unit_direction(seed, i, x.shape)``, so the numbers depend on neither chunking nor selection).

    Returns (numeric, analytic), one per direction: the difference quotient and <grad, taken>, where
    ``taken`` = ((x + h u) - (x - h u)) / 2h is the direction actually stepped in floating point.
    Memory stays within one chunk: directions are drawn where they are used.
    """
    h = float(step_size(float(np.max(np.abs(x), initial=0.0)), epsilon, size))
    numeric = np.empty(len(which), dtype=np.float64)
    analytic = np.empty(len(which), dtype=np.float64)
    step = x.dtype.type(h)
    g = np.asarray(grad, dtype=np.float64)

    def work(start: int, stop: int):
        u = np.stack([unit_direction(seed, int(i), x.shape) for i in which[start:stop]]).astype(x.dtype)
        plus, minus = x + step * u, x - step * u
        values = np.asarray(loss(np.concatenate([plus, minus])), dtype=np.float64)
        c = stop - start
        taken = (plus.astype(np.float64) - minus.astype(np.float64)) / (2 * h)
        return (values[:c] - values[c:]) / (2 * h), np.tensordot(taken, g, axes=x.ndim)

    for start, stop, (num, ana) in _in_chunks(work, len(which), chunking):
        numeric[start:stop], analytic[start:stop] = num, ana
        if progress:
            progress(stop - start)
    return numeric, analytic


def unit_direction(seed: int, index: int, shape: tuple[int, ...]) -> np.ndarray:
    """Random unit vector number ``index`` (Frobenius norm 1) of the given shape, float64."""
    u = np.random.default_rng([seed, index]).standard_normal(tuple(shape))
    return u / np.sqrt(np.sum(u * u))


def rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (float64) rounded to ``dtype`` (float16 or bfloat16: round to nearest even; or float32) and back: a
    statistic saved in a lower precision (known mistakes of norms and attention's saved LSE)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype != "bfloat16":
        return x.astype(dtype).astype(np.float64)
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


#: The precisions a statistic may be saved in by mistake (``rounded``).
SAVED_PRECISIONS = ("bfloat16", "float16")
