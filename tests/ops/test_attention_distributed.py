"""Context-parallel attention on real ranks (``distributed:``): the sharding's index arithmetic and the mask as
FlashAttention's window (hypothesis properties); the built-in ring, zigzag ring and Ulysses checked on gloo ranks
against one process; each context-parallel fault failing its checks; per-rank code that raises, exits or deadlocks
being a failed check naming the rank, with no rank left behind; the loader's refusals."""
import importlib.util
import subprocess

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention.distributed import keys, sharding, wire

from helpers import ROOT, make, with_code, with_examples


@given(copies=st.integers(1, 6), batch=st.integers(1, 3), n=st.integers(1, 12), ws=st.integers(1, 4),
       moved=st.integers(0, 40), axis=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_a_rank_rebuilds_exactly_the_shard_of_the_copies_it_was_sent(copies, batch, n, ws, moved, axis, seed):
    """wire.pack/unpack against sharding.shard: perturbed copies (a few entries each, NaN and -0.0 among them) or
    dense ones, every sharding's rows, both sequence axes."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((batch, 3, n, 2) if axis == 2 else (batch, n, 3, 2))
    x = np.repeat(base, copies, axis=0).reshape((copies * batch,) + base.shape[1:])
    flat = x.reshape(-1)
    at = rng.choice(flat.size, size=min(moved, flat.size), replace=False)
    flat[at] = rng.choice([np.nan, -0.0, 1e300, 0.5], size=at.size)
    diff = wire.differing(x, batch)
    for rows in sharding.rows(n, ws, "zigzag"):
        sent = wire.pack(x, batch, diff, rows, axis)
        got = wire.unpack({"q": sent})["q"]
        np.testing.assert_array_equal(got, sharding.shard(x, rows, axis))
        assert got.shape == sent.shape and got.flags.c_contiguous


def test_the_ring_s_forward_tiles_give_the_softmax_of_the_whole_block():
    """Scores.block (tiles of ROWS rows over the keys they see, copies a few at a time) against the softmax of the
    block's scores formed at once: causal diagonal and hidden blocks, zigzag chunks, a window, softcap and ALiBi."""
    torch = pytest.importorskip("torch")
    from gradcheck_cli.ops.attention.distributed import scores as ring_scores
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.arange(64, 128), torch.arange(64, 128), True, (-1, 0), None, None),
             (torch.arange(0, 40), torch.arange(50, 90), True, (-1, 0), None, None),
             (torch.cat([torch.arange(0, 32), torch.arange(224, 256)]),
              torch.cat([torch.arange(32, 64), torch.arange(192, 224)]), True, (-1, 0), 30.0,
              torch.tensor([0.5, 0.25, 0.1, 0.05], dtype=torch.float64)),
             (torch.arange(0, 100), torch.arange(0, 90), False, (20, 5), None, None)]
    for q_pos, k_pos, causal, window, cap, slopes in cases:
        q = torch.randn(300, 4, len(q_pos), 8, dtype=torch.float64, generator=gen)  # several batch steps
        k, v = (torch.randn(300, 2, len(k_pos), 8, dtype=torch.float64, generator=gen) for _ in "kv")
        sc = ring_scores.Scores(0.3, causal, window, cap, slopes)
        s, _ = sc(q, k, q_pos, k_pos)
        if bool(torch.isinf(s).all()):
            assert sc.block(q, k, v, q_pos, k_pos) is None
            continue
        o, lse = sc.block(q, k, v, q_pos, k_pos)
        want_lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(want_lse), want_lse, torch.zeros_like(want_lse))[..., None])
        torch.testing.assert_close(o, p @ v.repeat_interleave(2, 1), rtol=0, atol=1e-13)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-13)


@given(lengths=st.lists(st.integers(1, 20), min_size=1, max_size=4), ws=st.integers(1, 8),
       kind=st.sampled_from(sharding.SHARDINGS))
def test_every_row_is_held_by_exactly_one_rank_and_gather_undoes_shard(lengths, ws, kind):
    n, cu = sum(lengths), np.concatenate([[0], np.cumsum(lengths)])
    rows = sharding.rows(n, ws, kind, cu)
    assert len(rows) == ws
    assert sorted(np.concatenate(rows).tolist()) == list(range(n))
    x = np.random.default_rng(n).standard_normal((2, 3, n, 4))
    parts = [sharding.shard(x, r, 2) for r in rows]
    np.testing.assert_array_equal(sharding.gather(parts, rows, 2, n), x)


def test_zigzag_gives_rank_r_chunks_r_and_2ws_minus_1_minus_r():
    assert [r.tolist() for r in sharding.rows(8, 2, "zigzag")] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    # per document: each document's own 2 ws chunks (documents of 8 and 3 rows, the second one too short for all)
    assert [r.tolist() for r in sharding.rows(11, 2, "per-document", [0, 8, 11])] == [[0, 1, 6, 7, 8],
                                                                                      [2, 3, 4, 5, 9, 10]]
    assert [r.tolist() for r in sharding.rows(7, 3, "contiguous")] == [[0, 1, 2], [3, 4], [5, 6]]


@given(n=st.integers(1, 12), left=st.integers(-1, 12), right=st.integers(-1, 12), causal=st.booleans())
def test_band_reads_back_the_window_that_made_the_visible_set(n, left, right, causal):
    window = (None if left < 0 else left, None if right < 0 else right)
    visible = masks.build_visible(1, 2, n, n, causal="lower-right" if causal else None, window=window)
    got = keys.band(visible)
    d = np.arange(n)[None, :] - np.arange(n)[:, None]
    lo, hi = got
    rebuilt = np.ones((n, n), bool) & ((d >= -lo) if lo >= 0 else True) & ((d <= hi) if hi >= 0 else True)
    np.testing.assert_array_equal(rebuilt, visible[0, 0])


def test_without_torch_a_distributed_scenario_is_refused_naming_what_to_install():
    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed")
    with pytest.raises(ScenarioError, match=r"torch is not installed \(pip install 'attn-gradcheck\[torch\]'\)"):
        make(heads_q=2, n_q=6, d_head=2, distributed={"world_size": 2})


def test_a_visible_set_that_is_not_a_band_has_none():
    visible = masks.build_visible(2, 1, 5, 5, causal="lower-right", key_lengths=[5, 3])
    assert keys.band(visible) is None


@pytest.mark.parametrize("extra, key, words", [
    ({"n_k": 10}, "distributed", "n_q must equal n_k"),
    ({"mask": {"causal": "lower-right", "key_lengths": [6]}, "batch": 1}, "distributed", "causal and/or a window"),
    ({"distributed": {"world_size": 0}}, "distributed.world_size", "must be >= 1"),
    ({"distributed": {"world_size": 17}}, "distributed.world_size", "between 1 and 16"),
    ({"distributed": {"world_size": 3, "sharding": "ulysses"}}, "distributed.sharding", "not divisible"),
    ({"heads_kv": 1, "distributed": {"world_size": 2, "sharding": "ulysses"}}, "distributed.sharding",
     "heads_kv = 1 is not divisible"),
    ({"distributed": {"world_size": 5, "sharding": "zigzag"}}, "distributed", "leaves a rank without rows"),
    ({"check": {"mode": "jvp"}}, "distributed", "along the VJP"),
    ({"dropout": {"p": 0.1}}, "distributed", "dropout is not split over ranks"),
    ({"distributed": {"world_size": 2, "backend": "nccl"}}, "distributed.backend", "needs device: cuda"),
    ({"softcap": 3.0, "alibi": {}, "stages": ["alibi", "softcap"]}, "stages", "default order"),
    ({"distributed": {"world_size": 2, "sharding": "per-document"}}, "distributed.sharding", "has none"),
    ({"n_q": None, "varlen": {"seqlens_q": [3, 5]}, "batch": 1}, "distributed", "document by document"),
    ({"n_q": None, "varlen": {"seqlens_q": [2, 1]}, "batch": 1, "distributed": {"world_size": 4,
                                                                               "sharding": "per-document"}},
     "distributed", "without rows"),
    ({"backend": "jax", "implementation": "context_parallel_jax:ring_attention", "n_q": 9,
      "distributed": {"world_size": 2}}, "distributed", "not divisible by 2"),
    ({"backend": "jax", "implementation": "context_parallel_jax:ring_attention",
      "distributed": {"world_size": 2, "sharding": "zigzag", "backend": "nccl"}}, "distributed.backend",
     "jax.shard_map")])
def test_what_distributed_does_not_cover_is_refused_with_its_key(extra, key, words):
    # without torch (or JAX, for JAX code) the one refusal is that it is not installed
    pytest.importorskip("jax" if extra.get("backend") == "jax" else "torch")
    doc = {"heads_q": 4, "heads_kv": 2, "n_q": 8, "d_head": 4, "distributed": {"world_size": 2}, **extra}
    doc = {key: value for key, value in doc.items() if value is not None}
    with pytest.raises(ScenarioError) as err:
        with_examples(**doc)
    assert str(err.value.key).endswith(key) and words in str(err.value), str(err.value)


def test_check_timeout_applies_to_the_built_in_ring_on_its_ranks():
    pytest.importorskip("torch")
    assert make(heads_q=2, n_q=6, d_head=2, distributed={"world_size": 2}, check={"timeout": 30}).timeout == 30
    with pytest.raises(ScenarioError, match="applies to a scenario with an implementation"):
        make(heads_q=2, n_q=6, d_head=2, check={"timeout": 30})


def _ranks_left() -> list[str]:
    """Rank processes this test process started that are still alive (other test processes may run their own)."""
    import os
    out = subprocess.run(["ps", "-eo", "ppid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if "gradcheck_cli.ops.attention.distributed.rank" in line and int(line.split()[0]) == os.getpid()]


def test_the_built_in_ring_on_two_ranks_passes_and_a_stale_kv_backward_fails_it():
    pytest.importorskip("torch")
    sc = make(batch=1, heads_q=4, heads_kv=2, n_q=8, d_head=4, mask={"causal": "lower-right"},
              distributed={"world_size": 2})
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    assert "ring x2 contiguous" in sc.describe()
    failed = {c.name for c in checker.run_scenario(sc, ("cp-stale-kv",)).checks if c.verdict == "fail"}
    assert {"gradient k", "backward agrees with the reference"} <= failed, failed


@pytest.mark.slow
@pytest.mark.parametrize("distributed", [{"world_size": 3, "sharding": "zigzag"},
                                         {"world_size": 2, "sharding": "ulysses"}])
def test_the_built_in_ring_and_ulysses_take_the_variants_and_sum_their_parameters_over_the_ranks(distributed):
    """Softcap, learned ALiBi slopes and learned sinks on the ranks: the gathered output, LSE and gradients agree
    with one process in float64; with the parameters' gradients as rank 0 holds them, those checks fail."""
    pytest.importorskip("torch")
    sc = make(batch=1, heads_q=4, heads_kv=2, n_q=8, d_head=4, mask={"causal": "lower-right"}, softcap=3.0,
              alibi={"grad": True}, sinks={"grad": True}, outputs=["o", "lse"], distributed=distributed)
    result = checker.run_scenario(sc)
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
    names = {(c.name, c.tensor) for c in result.checks}
    assert {("gradient sinks", "sinks"), ("gradient alibi_slopes", "alibi_slopes")} <= names
    failed = {(c.name, c.tensor) for c in checker.run_scenario(sc, ("cp-param-not-summed",)).checks
              if c.verdict == "fail"}
    assert {("gradient sinks", "sinks"), ("gradient alibi_slopes", "alibi_slopes")} <= failed, failed
    assert not {t for _, t in failed} & {"q", "k", "v", "o", "lse"}, failed


@pytest.mark.slow
def test_jax_per_shard_code_runs_under_shard_map_and_a_hand_written_ring_backward_that_keeps_dkv_fails():
    """JAX: one process holding world_size emulated devices (the correct examples, learned sinks among them, pass
    in the slow suite); dK/dV kept on the rank that computed them last fails dK and dV only, with the hints that
    the same code is right on one rank and that the last rotation is missing."""
    pytest.importorskip("jax")
    from gradcheck_cli.scenario import load
    scenarios = {sc.name: sc for sc in load(ROOT / "examples" / "context_parallel_jax.yaml")}
    broken = checker.run_scenario(scenarios["broken-ring-vjp-dkv-not-home"])
    failed = {c.name for c in broken.checks if c.verdict == "fail"}
    assert {"gradient k", "gradient v"} <= failed and "gradient q" not in failed, failed
    assert any("sends each K/V block's accumulated dK/dV home" in h for h in broken.hints), broken.hints
    assert any("the same code on one rank is right, on 3 ranks it is not (dK, dV)" in h for h in broken.hints)


@pytest.mark.slow
@pytest.mark.parametrize("distributed, extra", [
    ({"world_size": 3, "sharding": "per-document"}, {"batch": 1, "varlen": {"seqlens_q": [6, 1, 8]},
                                                     "mask": {"causal": "lower-right", "window": [3, 0]}}),
    ({"world_size": 3}, {"outputs": ["o", "lse"], "n_q": 10}),
    ({"world_size": 4, "sharding": "zigzag"}, {"n_q": 13, "mask": {"causal": "lower-right", "window": [5, 0]}}),
    ({"world_size": 2, "sharding": "ulysses"}, {"dtype": "float32", "mask": {"causal": None}}),
    ({"world_size": 1}, {})])
def test_the_built_in_ring_zigzag_ulysses_and_per_document_pass(distributed, extra):
    pytest.importorskip("torch")
    doc = {"batch": 2, "heads_q": 4, "heads_kv": 2, "n_q": 9, "d_head": 4, "mask": {"causal": "lower-right"},
           "distributed": distributed, **extra}
    if "varlen" in doc:  # a packed batch: n_q is its documents' total
        del doc["n_q"]
    result = checker.run_scenario(make(**doc))
    assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]


_MISBEHAVING = '''
import os, torch, torch.distributed as dist

def attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size):
    if dist.get_rank(group) == 1:
        if HOW == "raise":
            raise ValueError("rank one is unhappy")
        if HOW == "exit":
            os._exit(3)
        if HOW == "deadlock":
            buf = torch.empty(1)
            dist.recv(buf, src=0, group=group)  # no rank sends it
    return q * 0
'''


@pytest.mark.slow
@pytest.mark.parametrize("how, words", [("raise", "rank 1 raised during the forward: ValueError: rank one is unhappy"),
                                        ("exit", "rank 1 exited with code 3"),
                                        ("deadlock", "rank 1 did not answer the forward")])
def test_a_rank_that_raises_exits_or_deadlocks_is_a_failed_check_naming_it(tmp_path, how, words):
    pytest.importorskip("torch")
    sc = with_code(tmp_path, _MISBEHAVING.replace("HOW ==", f"{how!r} =="), backend="torch",
                   function="attention", heads_q=2, n_q=6, d_head=4, distributed={"world_size": 2},
                   check={"timeout": 20})
    result = checker.run_scenario(sc)
    assert result.verdict == "fail"
    detail = " ".join(c.detail for c in result.checks if c.verdict == "fail")
    assert words in detail and "every rank was stopped" in detail, detail
    assert not _ranks_left()


_EXAMPLES = [(name, doc["name"]) for name in ("context_parallel.yaml", "context_parallel_ring.yaml",
                                              "recipes/torch_context_parallel.yaml", "context_parallel_jax.yaml")
             for doc in yaml.safe_load((ROOT / "examples" / name).read_text())["scenarios"]]


@pytest.mark.slow
@pytest.mark.parametrize("path, name", _EXAMPLES, ids=[f"{p}-{n}" for p, n in _EXAMPLES])
def test_the_per_rank_examples_pass_and_their_broken_variants_fail(path, name):
    """Per-rank code as users write it (all-gather, ring, zigzag ring, Ulysses) and torch's own ring internals (both
    rotate methods, head-tail load balancing), and JAX per-shard code under shard_map: the correct ones pass,
    broken-* fail."""
    pytest.importorskip("jax" if "jax" in path else "torch")
    from gradcheck_cli.scenario import load
    (sc,) = [sc for sc in load(ROOT / "examples" / path) if sc.name == name]
    result = checker.run_scenario(sc)
    assert result.verdict == ("fail" if name.startswith("broken-") else "pass"), \
        [(c.name, c.detail) for c in result.checks if c.verdict != "pass"]


@pytest.mark.slow
def test_the_public_context_parallel_recipe_is_refused_on_a_machine_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs it")
    config = ROOT / "examples" / "recipes" / "torch_context_parallel_cuda.yaml"
    out = subprocess.run(["attn-gradcheck", "run", str(config)], capture_output=True, text=True)
    assert out.returncode == 2 and "torch sees no CUDA device" in out.stderr + out.stdout, out
    assert "Traceback" not in out.stderr


_WRONG_EVERYWHERE = """
import torch
import torch.distributed.nn.functional as dnn


class Contiguous(torch.autograd.Function):  # gloo's all_gather backward needs contiguous gradients (torch 2.13)
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def attention(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size):
    keys = torch.cat([Contiguous.apply(p) for p in dnn.all_gather(k.contiguous(), group=group)], dim=2)
    values = torch.cat([Contiguous.apply(p) for p in dnn.all_gather(v.contiguous(), group=group)], dim=2)
    positions = torch.cat(dnn.all_gather(k_positions, group=group))
    s = q @ keys.transpose(-1, -2)  # the softmax scale forgotten: wrong on one rank as on several
    s = s.masked_fill(positions[None, :] > q_positions[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ values
"""


@pytest.mark.slow
def test_the_same_code_on_one_rank_says_whether_the_bug_is_in_the_exchange_or_in_the_attention(tmp_path):
    """Code wrong on one rank too passes 'same result on one rank' and is told the bug is in its attention; the
    built-in ring with a stale K/V backward fails it and is told the bug is in the exchange."""
    pytest.importorskip("torch")
    sc = with_code(tmp_path, _WRONG_EVERYWHERE, backend="torch", function="attention", heads_q=2, heads_kv=2, n_q=6,
                   d_head=4, mask={"causal": "lower-right"}, distributed={"world_size": 2})
    result = checker.run_scenario(sc)
    one = [c for c in result.checks if c.name == "same result on one rank"]
    assert {c.tensor for c in one} == {"o", "q", "k", "v"} and all(c.passed for c in one), one
    assert "forward agrees with the reference" in {c.name for c in result.checks if c.verdict == "fail"}
    assert any("the same wrong result on one rank" in h for h in result.hints), result.hints
    ring = make(batch=1, heads_q=4, heads_kv=2, n_q=8, d_head=4, mask={"causal": "lower-right"},
                distributed={"world_size": 2})
    stale = checker.run_scenario(ring, ("cp-stale-kv",))
    assert {c.tensor for c in stale.checks if c.name == "same result on one rank" and c.verdict == "fail"} \
        == {"q", "k", "v"}
    assert any("the same code on one rank is right, on 2 ranks it is not" in h for h in stale.hints), stale.hints


_WRONG_OUTPUT = """
def jax_wrong_shape(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size):
    return q[:, :, :-1]


def jax_none(q, k, v, *, axis_name, q_positions, k_positions, softmax_scale, causal, window_size):
    return None


def torch_wrong_shape(q, k, v, *, group, q_positions, k_positions, softmax_scale, causal, window_size):
    return q[:, :, :-1] * 1.0
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend, function, words", [
    ("jax", "jax_wrong_shape", "the JAX code raised during the forward: ValueError: the code returned o of shape "
                               "[1, 2, 3, 4] on each shard, expected [1, 2, 4, 4] (its process was stopped)"),
    ("jax", "jax_none", "the code returns o (an array), got None"),
    ("torch", "torch_wrong_shape", "raised during the forward: ValueError: the code returned o of shape "
                                   "[1, 2, 3, 4] on this rank, expected [1, 2, 4, 4]")])
def test_a_per_rank_output_of_the_wrong_shape_or_none_is_named_in_the_shard_s_terms(tmp_path, backend, function,
                                                                                    words):
    pytest.importorskip(backend)
    sc = with_code(tmp_path, _WRONG_OUTPUT, backend=backend, function=function, heads_q=2, n_q=8, d_head=4,
                   distributed={"world_size": 2})
    result = checker.run_scenario(sc)
    detail = " ".join(c.detail for c in result.checks if c.verdict == "fail")
    assert words in detail, detail
