"""Checking a user's own code: the tool's time against its floor and against torch.autograd.gradcheck of the
same function, in the same run (issue 14, item 5).

The user's code is PyTorch's SDPA behind the tool's torch interface (benchmarks/user_sdpa.py), float64,
causal, B=1, H=1, at n=64, d=32 and n=128, d=64, full mode. Every call of the user's forward is recorded
with its batch size (the finite differences stack perturbed copies along the batch axis).

- tool: the wall time of ``checker.run_scenario`` (in this process: torch's import is not counted).
- floor: the same calls replayed: one forward of the user's function per recorded call, at its batch size,
  on fresh random inputs (what any black-box check of this many copies must spend in the user's code).
- gradcheck: ``torch.autograd.gradcheck`` of the scalar L = sum(O * G) in q, k, v (the like-for-like
  comparison: attn-gradcheck differentiates L too), once.
- worker: the scenario as ``attn-gradcheck run`` checks it, in a fresh worker process forked from the fork
  server (``runner.check_isolated``; the server started once, before): the wall time of the check and the
  ``elapsed_s`` the worker reports, what a user sees per scenario (the worker's start, its first calls).

The floor is serial; the tool runs its chunks of copies on ``numeric.WORKERS`` threads (torch releases the
GIL), so on a machine with spare cores it can come in under it. Each figure is the median of ``--repeat``
runs (tool and floor alike), so a machine shared with other work moves it less.

The second table times the same scenarios with the NumPy and the JAX flavours of a user's attention
(examples/my_attention.py, examples/jax_attention.py): the tool's median time on warm runs, and for JAX
the first run's jax.jit compilation (``jax_flavour``'s ``state.compile_s``, summed over the shapes it
compiled) apart from it. Skipped for a flavour whose framework is not installed.

    python benchmarks/bench_user_code.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

import yaml

from gradcheck_cli import checker, runner, scenario

HERE = Path(__file__).resolve().parent
SHAPES = [(64, 32), (128, 64)]


def _scenario(n: int, d: int):
    doc = {"scenarios": [{"name": f"sdpa-n{n}-d{d}", "n_q": n, "d_head": d, "backend": "torch",
                          "mask": {"causal": "lower-right"}, "implementation": "user_sdpa:sdpa"}]}
    return scenario.loads(yaml.safe_dump(doc), base_dir=HERE)[0]


def _flavour_scenario(n: int, d: int, backend: str):
    spec = {"numpy": "my_attention:attention", "jax": "jax_attention:attention"}[backend]
    doc = {"scenarios": [{"name": f"{backend}-n{n}-d{d}", "n_q": n, "d_head": d, "backend": backend,
                          "mask": {"causal": "lower-right"}, "implementation": spec}]}
    return scenario.loads(yaml.safe_dump(doc), base_dir=HERE.parent / "examples")[0]


def _flavours(repeat: int) -> None:
    """The NumPy and JAX flavours on the same shapes: median warm time against the floor of the same calls
    replayed (the user's NumPy forward; the JAX function as compiled), and JAX's compilation apart."""
    import numpy as np

    from gradcheck_cli import implementation
    from gradcheck_cli.flavours import jax as jax_flavour
    calls: list[int] = []
    replay = {}
    states = []
    if importlib.util.find_spec("jax") is not None:
        wrap = jax_flavour.wrap

        def recording(*args, **kwargs):  # keeps each build's state (compile_s) and records the forward's calls
            out = wrap(*args, **kwargs)
            states.append(out.state)
            forward = out.forward
            replay["jax"] = forward

            def counted(*a):
                calls.append(a[0].shape[0])
                return forward(*a)
            counted.immutable = getattr(forward, "immutable", False)  # as the flavour's own (no defensive copies)
            out.forward = counted
            return out
        jax_flavour.wrap = recording
    print(f"\n{'scenario':<16} {'flavour':>7} {'tool s':>8} {'floor s':>8} {'tool/floor':>10} {'first run s':>11} "
          f"{'jit compile s':>13}")
    for n, d in SHAPES:
        for backend in ("numpy", "jax"):
            if backend == "jax" and importlib.util.find_spec("jax") is None:
                continue
            sc = _flavour_scenario(n, d, backend)
            if backend == "numpy":  # the engine's calls of the user's forward, recorded
                user = implementation.load(sc.implementation, Path(sc.base_dir), flavour="numpy")
                replay["numpy"] = user.forward
                key = next(k for k, v in implementation._LOADED.items() if v is user)

                def counted(*a, _forward=user.forward):
                    calls.append(a[0].shape[0])
                    return _forward(*a)
                implementation._LOADED[key] = types.SimpleNamespace(forward=counted, backward=user.backward)
            states.clear()
            start = time.perf_counter()
            result = checker.run_scenario(sc)  # the first run: JAX traces and compiles here
            first = time.perf_counter() - start
            compile_s = sum(s.compile_s for s in states)
            assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
            times, floors = [], []
            for _ in range(repeat):
                calls.clear()
                start = time.perf_counter()
                checker.run_scenario(sc)
                times.append(time.perf_counter() - start)
                floors.append(_replay(replay[backend], list(calls), n, d, np))
            shown = f"{compile_s:13.2f}" if backend == "jax" else f"{'-':>13}"
            tool, floor = statistics.median(times), statistics.median(floors)
            print(f"{sc.name:<16} {backend:>7} {tool:8.3f} {floor:8.3f} {tool / floor:10.2f} {first:11.3f} {shown}")


def _replay(forward, calls: list[int], n: int, d: int, np) -> float:
    """The floor of a NumPy or JAX forward: one call per recorded call, at its batch size, on fresh inputs."""
    rng = np.random.default_rng(0)
    visible = np.tril(np.ones((n, n), dtype=bool))
    kv_map = np.zeros(1, dtype=np.intp)
    total = 0.0
    for batch, count in collections.Counter(calls).items():
        q, k, v = (rng.standard_normal((batch, 1, n, d)) for _ in range(3))
        vis = np.broadcast_to(visible, (batch, 1, n, n)).copy()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            forward(q, k, v, vis, d ** -0.5, kv_map)
            best = min(best, time.perf_counter() - start)
        total += best * count
    return total


def _floor(calls: list[int], n: int, d: int, repeat: int) -> float:
    import torch
    import user_sdpa
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    kv_map = torch.zeros(1, dtype=torch.long)
    total = 0.0
    for batch, count in collections.Counter(calls).items():
        q, k, v = (torch.randn(batch, 1, n, d, dtype=torch.float64) for _ in range(3))
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            user_sdpa.sdpa(q, k, v, visible, d ** -0.5, kv_map)
            best = min(best, time.perf_counter() - start)
        total += best * count
    return total


def _gradcheck(n: int, d: int) -> float:
    import torch
    import user_sdpa
    q, k, v = (torch.randn(1, 1, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    g = torch.randn(1, 1, n, d, dtype=torch.float64)
    visible = torch.ones(n, n, dtype=torch.bool).tril()
    kv_map = torch.zeros(1, dtype=torch.long)
    start = time.perf_counter()
    assert torch.autograd.gradcheck(lambda q, k, v: (user_sdpa.sdpa(q, k, v, visible, d ** -0.5, kv_map) * g).sum(),
                                    (q, k, v))
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-flavours", action="store_true", help="skip the NumPy and JAX table")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import user_sdpa
    print(f"{'scenario':<16} {'tool s':>8} {'floor s':>8} {'tool/floor':>10} {'calls':>6} {'copies':>7} "
          f"{'gradcheck s':>11} {'gradcheck/tool':>14} {'worker s':>8} {'elapsed_s':>9} {'worker/floor':>12}")
    for n, d in SHAPES:
        sc = _scenario(n, d)
        checker.run_scenario(sc)  # warm: imports, first calls
        runner.check_isolated(str(HERE / "bench_user_code.py"), sc)  # the fork server started (torch imported)
        times, floors, calls = [], [], []
        for _ in range(args.repeat):  # tool and floor alternate, so a change of the machine's load hits both
            user_sdpa.CALLS.clear()
            start = time.perf_counter()
            result = checker.run_scenario(sc)
            times.append(time.perf_counter() - start)
            calls = list(user_sdpa.CALLS)
            floors.append(_floor(calls, n, d, 3))
        assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
        walls, elapsed = [], []
        for _ in range(args.repeat):  # a fresh worker each time, as for every scenario of a run
            start = time.perf_counter()
            outcome = runner.check_isolated(str(HERE / "bench_user_code.py"), sc)
            walls.append(time.perf_counter() - start)
            elapsed.append(outcome.result.elapsed_s)
            assert outcome.result.verdict == "pass"
        best, floor = statistics.median(times), statistics.median(floors)
        worker = statistics.median(walls)
        grad = _gradcheck(n, d)
        print(f"{sc.name:<16} {best:8.3f} {floor:8.3f} {best / floor:10.2f} {len(calls):6d} {sum(calls):7d} "
              f"{grad:11.2f} {grad / best:14.1f} {worker:8.3f} {statistics.median(elapsed):9.3f} "
              f"{worker / floor:12.2f}")
    if not args.no_flavours:
        _flavours(args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
