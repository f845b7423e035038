"""The ranks of a context-parallel check: ``world_size`` processes started by the tool (``RANK_MODULE``, in the
scenario worker's process group, so they die with it), joined in one torch.distributed process group through a file
store in a private temporary folder (gloo bound to the loopback interface: nothing listens beyond this machine), each
connected to the tool by its own socket pair (inherited, no listener).

:class:`Ranks` sends every rank its part of one call (its shards, the loss's upstream gradients), waits for all of
them until the scenario's deadline, and returns their answers. A rank that raises, exits, or does not answer in time
(a deadlock in a collective) stops every rank and removes the folder; the failure names the rank
(:class:`RankFailure`, an implementation failure: a failed check, never a hang or an orphan process)."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait

from ....implementation import ImplementationFailure

#: The module each rank runs (torch.distributed), and the one process of JAX code under shard_map.
RANK_MODULE = "gradcheck_cli.ops.attention.distributed.rank"
JAX_MODULE = "gradcheck_cli.ops.attention.distributed.jax_host"
#: How often the tool looks at ranks that have not answered (seconds).
POLL_S = 0.05


class RankFailure(ImplementationFailure):
    """A rank raised, exited, or did not answer in time; every rank has been stopped."""


class Ranks:
    """``world_size`` rank processes running ``spec`` (a per-rank function, ``module:attribute``)."""

    def __init__(self, world_size: int, backend: str, spec: str, base_dir: str, dtype: str, device: str,
                 deadline: float):
        """``backend`` gloo or nccl: ``world_size`` processes of torch.distributed; jax: one process holding
        ``world_size`` devices (:mod:`.jax_host`; on the CPU, emulated by XLA)."""
        self.deadline = deadline
        self.jax = backend == "jax"
        processes, module, extra = world_size, RANK_MODULE, {}
        if backend == "jax":
            processes, module = 1, JAX_MODULE
            extra = {"JAX_ENABLE_X64": "1", "XLA_FLAGS": " ".join(
                [os.environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={world_size}"]).strip()}
            if device == "cpu":
                extra["JAX_PLATFORMS"] = "cpu"
        self.world_size = processes
        self.folder = tempfile.mkdtemp(prefix="attn-gradcheck-ranks-")
        self.procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self.conns: list = []
        self.dead: str | None = None
        started = time.perf_counter()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}
        try:
            for r in range(processes):
                mine, theirs = multiprocessing.Pipe()
                with open(os.path.join(self.folder, f"rank{r}.err"), "wb") as err:
                    self.procs.append(subprocess.Popen(
                        [sys.executable, "-m", module, str(theirs.fileno()), str(r)],
                        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                        pass_fds=(theirs.fileno(),)))
                theirs.close()
                self.conns.append(mine)
            config = {"world_size": world_size, "backend": backend, "spec": spec, "base_dir": base_dir,
                      "dtype": dtype, "device": device, "store": os.path.join(self.folder, "store"),
                      "timeout": max(1.0, deadline - time.monotonic())}
            self._call([config] * processes, what="start-up")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started

    def _check_exits(self, what: str, answered) -> None:
        for r, proc in enumerate(self.procs):
            if r not in answered and proc.poll() is not None:
                self._fail(f"{self._who(r)} exited with code {proc.returncode} during the {what}" + self._stderr(r))

    def _stderr(self, r: int) -> str:
        try:
            with open(os.path.join(self.folder, f"rank{r}.err"), encoding="utf-8", errors="replace") as f:
                tail = f.read()[-600:].strip()
        except OSError:
            return ""
        return f" (its last words: {tail.splitlines()[-1]})" if tail else ""

    def call(self, payloads: list, what: str = "call") -> list:
        """Each rank's answer to its payload (rank r gets ``payloads[r]``), all ranks running at once; one call at a
        time (the finite differences call from several threads, and the ranks answer one call after another)."""
        with self._lock:
            return self._call(payloads, what)

    def _call(self, payloads: list, what: str) -> list:
        if self.dead:
            raise RankFailure(self.dead)
        for conn, payload in zip(self.conns, payloads):
            conn.send(payload)
        answers: dict[int, object] = {}
        while len(answers) < self.world_size:
            left = self.deadline - time.monotonic()
            if left <= 0:
                silent = [r for r in range(self.world_size) if r not in answers]
                if self.jax:
                    self._fail(f"the JAX code did not answer the {what} before the scenario's deadline (check.timeout, "
                               "which includes JAX's compilation of the sharded function): a hang in the code, or a "
                               "compilation slower than the timeout (raise check.timeout)")
                self._fail(f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer the "
                           f"{what} before the scenario's deadline (check.timeout): a deadlock in a collective (a "
                           "send without its receive, ranks calling collectives in different orders) or a hang"
                           + (f"; ranks {', '.join(map(str, sorted(answers)))} had answered" if answers else ""))
            ready = wait([c for r, c in enumerate(self.conns) if r not in answers], min(POLL_S, left))
            for conn in ready:
                r = self.conns.index(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    try:
                        self.procs[r].wait(timeout=2.0)
                    except subprocess.TimeoutExpired:
                        pass
                    self._check_exits(what, answers)
                    self._fail(f"{self._who(r)} closed its connection during the {what}" + self._stderr(r))
                if status == "error":
                    self._fail(f"{self._who(r)} raised during the {what}: {value}")
                answers[r] = value
            self._check_exits(what, answers)
        return [answers[r] for r in range(self.world_size)]

    def _who(self, r: int) -> str:
        """How a failure names the process: rank r, or the JAX code (one process holding every device)."""
        return "the JAX code" if self.jax else f"rank {r}"

    def _fail(self, message: str):
        self.dead = f"{message} ({'its process' if self.jax else 'every rank'} was stopped)"
        self.stop()
        raise RankFailure(self.dead)

    def stop(self) -> None:
        """Stop every rank (a polite word, then a kill) and remove the folder."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        end = time.monotonic() + 2.0
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []
        shutil.rmtree(self.folder, ignore_errors=True)
