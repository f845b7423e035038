"""Reading the files a run is given: only regular files, never more than a stated size, and a ``.npy``
array's header read and checked before any of its data is. A FIFO, a device (``/dev/zero``), a folder or
an archive gets one message, never a hang, an endless read or a traceback. Imports nothing of ours.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

#: The largest scenario file read: a scenario file is a few kilobytes, and YAML parses at about a
#: megabyte a second (masks of any size go in .npy files).
MAX_CONFIG_BYTES = 2**20
#: The largest JSON report ``merge`` reads.
MAX_REPORT_BYTES = 512 * 2**20


class FileProblem(ValueError):
    """A file that cannot be used; the message says why (without the path, which the caller places)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike):
    """A binary file object for ``path``, which must be a regular file. Opened without blocking (a FIFO
    with no writer would otherwise wait forever), then checked with fstat, so the file read is the file
    checked."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except ValueError:  # a NUL byte in the path
        raise FileProblem("cannot read the file: the path contains a NUL byte") from None
    except OSError as exc:
        raise FileProblem(f"cannot read the file: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileProblem(f"is {_kind(mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes."""
    with open_regular(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FileProblem(f"is {size / 2**20:.1f} MiB; at most {limit / 2**20:.0f} MiB is read")
        try:
            data = fh.read(limit + 1)
        except OSError as exc:  # EIO, a file of /proc that refuses to be read
            raise FileProblem(f"cannot read the file: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise FileProblem(f"is over {limit / 2**20:.0f} MiB; at most that is read")
    return data


def load_npy(path: str | os.PathLike, max_elements: int, max_dims: int = 4, numbers: bool = False) -> np.ndarray:
    """A ``.npy`` array of booleans or integers (``numbers``: of real numbers, a bias's values) with at most
    ``max_elements`` elements and ``max_dims`` dimensions, its header read and checked (kind, shape, size, file
    length) before its data is."""
    try:
        with open_regular(path) as fh:
            return _load_npy(fh, max_elements, max_dims, numbers)
    except OSError as exc:  # a file that fails while read (EIO, a vanished mount)
        raise FileProblem(f"cannot read the file: {exc.strerror or exc}") from None


def _load_npy(fh, max_elements: int, max_dims: int, numbers: bool = False) -> np.ndarray:
    from numpy.lib import format as npy
    size = os.fstat(fh.fileno()).st_size
    head = fh.read(6)
    fh.seek(0)
    if head[:4] == b"PK\x03\x04":
        raise FileProblem("is a .npz archive, not a .npy array: save the array with numpy.save(path, array)")
    if head != b"\x93NUMPY":
        raise FileProblem("is not a .npy file (no NumPy header)" if size else "is empty, not a .npy file")
    try:
        version = npy.read_magic(fh)
        shape, fortran, dtype = (npy.read_array_header_1_0 if version == (1, 0) else
                                 npy.read_array_header_2_0)(fh, max_header_size=10_000)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 -- numpy's header parser raises what its tokenizer does
        raise FileProblem(f"has a damaged .npy header ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(shape, tuple) or not all(type(n) is int and n >= 0 for n in shape):
        raise FileProblem(f"has a damaged .npy header (shape {str(shape)[:200]} is not a tuple of sizes)")
    if len(shape) > max_dims:
        raise FileProblem(f"has {len(shape)} dimensions; {'an array' if numbers else 'a mask'} has at most "
                          f"{max_dims} ([B, Hq, n_q, n_k])")
    if numbers and (dtype.hasobject or dtype.kind not in "iuf"):
        raise FileProblem(f"holds {dtype}, not real numbers")
    if not numbers and (dtype.hasobject or dtype.kind not in "biu"):
        raise FileProblem(f"holds {dtype}, not booleans (or the integers 0 and 1)")
    count = int(np.prod(shape, dtype=object)) if shape else 1
    if count > max_elements:
        raise FileProblem(f"claims {count:,} elements (shape {list(shape)}); this scenario's has at most "
                          f"{max_elements:,}")
    if size - fh.tell() < count * dtype.itemsize:
        raise FileProblem(f"is truncated: its header claims shape {list(shape)} ({count * dtype.itemsize:,} bytes) "
                          f"but only {size - fh.tell():,} follow")
    fh.seek(0)
    try:
        return np.load(fh, allow_pickle=False)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise FileProblem(f"cannot be read as a .npy array ({type(exc).__name__}: {str(exc)[:200]})") from None


def is_regular_or_absent(path: str | os.PathLike) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return True
    except OSError:
        return False


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()
