"""Report files on disk: every output path checked before a run (``prepare_outputs``), and all reports
written atomically (temp file in the same folder, then rename): never half-written, all new or all as
they were; character devices and FIFOs written through."""
from __future__ import annotations

import errno
import io
import os
import re
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .. import files as _files
from ..errors import GradcheckError, ReportsFailed, ReportsInterrupted, Terminated
from ..result import ScenarioResult
from .registry import REPORTER_BY_NAME


def _probe(folder: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".attn-gradcheck-probe.", dir=folder)
    os.close(fd)
    os.unlink(tmp)


#: Kinds of file a run reads that no report replaces, wherever they are (a helper module that an
#: implementation imports is not known before the run).
INPUT_SUFFIXES = {".py": "Python module", ".pyi": "Python stub", ".yaml": "YAML file", ".yml": "YAML file",
                  ".npy": "NumPy array", ".npz": "NumPy archive"}


def prepare_outputs(files: dict[str, str | None], folders: dict[str, str | None],
                    folder_files: dict[str, Sequence[str]] | None = None, inputs: Sequence[str] = (),
                    replaceable: Sequence[str] = ()) -> None:
    """Before anything runs: every file a run will write (``files``, and ``folder_files[opt]`` inside
    ``folders[opt]``) is distinct and is none of ``inputs``; folders exist (created if missing) and
    can be written. A file of an input's kind (YAML, ...) is never replaced, but for those in ``replaceable``
    (what an earlier run of the same command wrote, as a hunt's scenario file)."""
    for opt, p in [*files.items(), *folders.items()]:
        if p is not None and not str(p).strip():
            raise GradcheckError(f"{opt} {p!r}: an empty path; give a file path")
        if p and "\x00" in p:
            raise GradcheckError(f"{opt} {p!r}: the path contains a NUL byte")
    for opt, p in files.items():
        if p and (p.endswith(os.sep) or p.endswith("/")):
            raise GradcheckError(f"{opt} {p}: names a folder; give a file path, e.g. {p.rstrip('/' + os.sep)}/report")
    targets: dict[Path, str] = {Path(p).resolve(): f"the input {p}" for p in inputs}
    targets.update({Path(p).resolve(): f"the {opt} folder {p}" for opt, p in folders.items() if p})
    wanted = [(opt, Path(p)) for opt, p in files.items() if p]
    wanted += [(f"{opt} ({_cut(name)})", Path(folders[opt]) / name)
               for opt, names in (folder_files or {}).items() if folders.get(opt) for name in names]
    for what, p in wanted:  # first: a name too long for the file system makes every stat of it fail
        _fits(what, p, member=what not in files)
    for what, p in wanted:
        key = p.resolve()
        if key in targets:
            raise GradcheckError(f"{what} would overwrite {targets[key]} ({p}); give another path")
        if p.suffix.lower() in INPUT_SUFFIXES and p.suffix.lower() != ".npz" and _files.is_regular_or_absent(p) \
                and p.exists() and str(p) not in replaceable:
            raise GradcheckError(f"{what} would overwrite {p}, a {INPUT_SUFFIXES[p.suffix.lower()]} (perhaps one "
                                 "the run reads); a report never replaces one: give another path")
        targets[key] = what
    for opt, p in [(o, Path(p)) for o, p in {**files, **folders}.items() if p]:
        is_folder = opt in folders
        try:
            if is_folder:
                if p.exists() and not p.is_dir():
                    raise GradcheckError(f"{opt} {p}: exists and is not a folder")
                p.mkdir(parents=True, exist_ok=True)
                _probe(p)
            else:
                if p.is_dir():
                    raise GradcheckError(f"{opt} {p}: is a folder; give a file path")
                if not _files.is_regular_or_absent(p):
                    mode = os.stat(p).st_mode
                    if not (stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)):
                        raise GradcheckError(f"{opt} {p}: is neither a regular file nor a device or FIFO to write "
                                             "through; give a file path")
                    if stat.S_ISFIFO(mode):
                        _hold_fifo(opt, p)
                    continue  # written through (``--json /dev/null`` discards), never renamed over
                p.parent.mkdir(parents=True, exist_ok=True)
                _probe(p.parent)
        except OSError as exc:
            raise GradcheckError(f"{opt} {p}: cannot write there ({exc.strerror or exc})") from None
    for what, p in wanted:
        try:
            if what not in files and (p.is_dir() or not _files.is_regular_or_absent(p)):  # a --save-arrays member
                raise GradcheckError(f"{what}: {p} exists and is not a regular file; remove it or choose another "
                                     "folder")
        except OSError as exc:
            raise GradcheckError(f"{what}: {p}: cannot write there ({exc.strerror or exc})") from None
    remove_stale_stages({p.parent for _, p in wanted if p.parent.exists()}, keep=inputs)


def _fits(what: str, p: Path, member: bool) -> None:
    """``p``'s file name, and the whole path, within what the file system allows (NAME_MAX, PATH_MAX);
    ``member``: a file of a folder option, named after a scenario."""
    limits = {}
    for key, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            limits[key] = os.pathconf(p.parent if p.parent.is_dir() else Path("."), key)
        except (OSError, ValueError):
            limits[key] = default
    name, whole = len(os.fsencode(p.name)), len(os.fsencode(str(p)))
    where = what if member else f"{what} {_cut(str(p))}"
    if name > limits["PC_NAME_MAX"]:
        raise GradcheckError(f"{where}: the file name is {name} bytes; this file system allows {limits['PC_NAME_MAX']}"
                             + (" (the scenario's name makes it: shorten the name or its sweep's values, nothing has "
                                "run)" if member else ""))
    if whole >= limits["PC_PATH_MAX"]:
        raise GradcheckError(f"{where}: the path is {whole} bytes; this system allows {limits['PC_PATH_MAX'] - 1}")


def _cut(text: str) -> str:
    """A path as messages show it: whole up to 100 characters, else its two ends."""
    return text if len(text) <= 100 else f"{text[:60]}...{text[-30:]} ({len(text)} characters)"


#: Staged report files are named .attn-gradcheck-<pid>-<random>.tmp beside their targets, whatever the
#: target's name (a long name cannot make the staging name too long), so a later run can recognise and
#: remove those that a killed run (kill -9) left behind.
STAGE_PREFIX = ".attn-gradcheck-"


class StagedWrites:
    """Write every report to a temp file beside its target, then put them all in place, so no report
    is ever half-written and the reports are all new or all as they were: each target that existed is
    kept under a hard link until every rename succeeded, and a failure (or Ctrl-C) while putting them
    in place puts the old ones back. A target that is a character device or a FIFO (``--json
    /dev/null``) is written through, never renamed over, and first: what it was sent cannot be taken
    back, but a failure there leaves every file as it was."""

    def __init__(self) -> None:
        self._staged: list[tuple[str, Path]] = []
        self._through: list[tuple[Path, bytes]] = []
        self.committed: list[Path] = []

    def add(self, path: str | os.PathLike, write: Callable[[io.BufferedWriter], None]) -> None:
        path = Path(path)
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        if not _files.is_regular_or_absent(path):  # /dev/null, a FIFO: written through at commit
            buffer = io.BytesIO()
            write(buffer)
            self._through.append((path, buffer.getvalue()))
            return
        fd, tmp = _stage_file(path.parent)
        self._staged.append((tmp, path))
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)

    def __enter__(self) -> StagedWrites:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._discard()
            return
        replaced: list[tuple[Path, str | None]] = []  # (target, the hard link keeping its old file)
        try:
            for path, data in self._through:
                _write_through(path, data)
                self.committed.append(path)
            for tmp, path in self._staged:
                replaced.append((path, _keep_old(path)))
                os.replace(tmp, path)
                self.committed.append(path)
        except BaseException as failure:
            restored = _put_back(replaced, self.committed)
            self._discard()
            written = [str(p) for p in self.committed if p not in restored]
            pending = [str(p) for _, p in self._staged if str(p) not in written] + \
                [str(p) for p, _ in self._through if p not in self.committed]
            if isinstance(failure, KeyboardInterrupt):
                raise ReportsInterrupted(written, pending, isinstance(failure, Terminated)) from None
            raise ReportsFailed(written, pending, failure) from None
        for _, old in replaced:
            if old:
                Path(old).unlink(missing_ok=True)

    def _discard(self) -> None:
        for tmp, _ in self._staged:
            Path(tmp).unlink(missing_ok=True)


def _stage_file(folder: Path) -> tuple[int, str]:
    return tempfile.mkstemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", suffix=".tmp", dir=folder)


def _keep_old(path: Path) -> str | None:
    """A hard link to the file at ``path`` (a staging name); "" when there is no file there; None when
    the file system has no hard links (then a failure cannot put that one back, and says so)."""
    if not path.exists():
        return ""
    fd, name = _stage_file(path.parent)
    os.close(fd)
    os.unlink(name)
    try:
        os.link(path, name)
    except OSError:
        return None
    return name


def _put_back(replaced: list[tuple[Path, str | None]], committed: list[Path]) -> set[Path]:
    """Undo the renames that happened: the old file back where there was one, the new one removed where
    there was none. The targets put back (best effort: a second failure leaves that one new)."""
    done = set()
    for path, old in reversed(replaced):
        if path not in committed:
            if old:
                Path(old).unlink(missing_ok=True)
            continue
        if old is None:
            continue  # no hard link to put back: that report stays new, and is named so
        try:
            if old:
                os.replace(old, path)
            else:
                path.unlink()  # there was no file: the new one goes
            done.add(path)
        except BaseException:  # noqa: BLE001 -- a second Ctrl-C: that report stays new, and is named so
            pass
    return done


#: Seconds a special file may refuse every byte before the write is given up (a FIFO whose reader
#: holds it open but stopped reading).
STALL_S = 60.0


#: FIFOs given as report targets, opened for writing when the run starts (so one without a reader is
#: refused before the run) and kept open until the report is written through (closing it in between
#: would end its reader's input).
_HELD_FIFOS: dict[str, int] = {}


def _hold_fifo(opt: str, path: Path) -> None:
    key = os.path.abspath(path)
    if key in _HELD_FIFOS:
        return
    try:
        _HELD_FIFOS[key] = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise GradcheckError(f"{opt} {path}: a FIFO with no reader; start its reader first") from None
        raise


def _write_through(path: Path, data: bytes) -> None:
    """Write into a special file in place: a FIFO without a reader is an error, not a wait, and one
    whose reader stops reading for STALL_S seconds is an error too."""
    import select
    fd = _HELD_FIFOS.pop(os.path.abspath(path), None)
    if fd is None:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                if not select.select([], [fd], [], STALL_S)[1]:
                    raise OSError(errno.ETIMEDOUT, f"nothing could be written to {path} for {STALL_S:g} s (its "
                                                   "reader stopped reading)") from None
    finally:
        os.close(fd)


#: The exact shape of a staged file's name (tempfile.mkstemp's 8 random characters): nothing else that
#: merely starts with the prefix is ever removed.
_STAGE_NAME = re.compile(re.escape(STAGE_PREFIX) + r"(\d{1,7})-[a-z0-9_]{8}\.tmp")


def remove_stale_stages(folders, keep=()) -> None:
    """Staged files that runs killed with -9 left behind: a regular file of this user whose name has
    exactly the staging shape, whose process is gone, and that is not one of ``keep`` (this run's
    inputs)."""
    kept = {Path(p).resolve() for p in keep}
    for folder in {Path(f).resolve() for f in folders}:
        try:
            entries = list(folder.glob(f"{STAGE_PREFIX}*.tmp"))
        except OSError:
            continue
        for entry in entries:
            match = _STAGE_NAME.fullmatch(entry.name)
            if not match or entry in kept or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
                continue
            try:
                info = entry.lstat()
                if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
                    entry.unlink()
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def write_reports(json_path=None, json_data: dict | None = None, junit_path=None, junit_data: bytes | None = None,
                  arrays_dir=None, results: Sequence[ScenarioResult] = (), html_path=None) -> None:
    """All requested reports, atomically; raises OSError when one cannot be written (then none is).
    Each report file is rendered from ``json_data`` by its reporter (REPORTER_BY_NAME), unless its bytes
    are given (``junit_data``)."""
    given = {"json": None, "junit": junit_data, "html": None}
    with StagedWrites() as stage:
        for name, path in (("json", json_path), ("junit", junit_path), ("html", html_path)):
            if path:
                data = given[name] if given[name] is not None else REPORTER_BY_NAME[name](json_data)
                stage.add(path, lambda fh, data=data: fh.write(data))
        if arrays_dir:
            for r in results:
                stage.add(Path(arrays_dir) / f"{r.name}.npz", lambda fh, r=r: np.savez(fh, **r.arrays))
