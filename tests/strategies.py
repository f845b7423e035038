"""Hypothesis strategies shared by several test modules: attention scenarios (as YAML keys) and raw
attention problems (arrays, a visible set, block sizes)."""
import numpy as np
from hypothesis import strategies as st

from gradcheck_cli import masks

from helpers import make


@st.composite
def scenarios(draw):
    heads_kv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    heads_q = heads_kv * group
    n_q = draw(st.integers(1, 7))
    n_k = draw(st.integers(1, 9))
    batch = draw(st.integers(1, 2))
    keys = dict(batch=batch, heads_q=heads_q, n_q=n_q, n_k=n_k, d_head=draw(st.integers(1, 5)),
                d_value=draw(st.integers(1, 4)), seed=draw(st.integers(0, 2**16)))
    keys["heads_kv"] = heads_kv
    if draw(st.booleans()):  # an explicit map in which every KV head serves some query head
        extra = draw(st.lists(st.integers(0, heads_kv - 1), min_size=heads_q - heads_kv, max_size=heads_q - heads_kv))
        keys["kv_map"] = draw(st.permutations(list(range(heads_kv)) + extra))
    mask = {}
    causal = draw(st.sampled_from(["none", "upper-left", "lower-right"]))
    if causal == "upper-left" or (causal == "lower-right" and n_q > n_k):
        # rows whose diagonal is negative would be empty; keep most scenarios valid
        n_k = max(n_k, n_q)
        keys["n_k"] = n_k
    mask["causal"] = causal
    if draw(st.booleans()):
        side = st.one_of(st.none(), st.just(-1), st.integers(0, 4))
        mask["window"] = [draw(side), draw(side)]
    if draw(st.booleans()):
        mask["key_lengths"] = [draw(st.integers(1, n_k)) for _ in range(batch)]
    if draw(st.booleans()):
        rng = np.random.default_rng(keys["seed"])
        vis = rng.random((n_q, n_k)) < 0.6
        vis[np.arange(n_q), rng.integers(0, n_k, n_q)] = True
        mask["visible"] = vis.tolist()
    keys["mask"] = mask
    if draw(st.booleans()):
        keys["scale"] = draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]))
    return keys


def valid_or_none(keys):
    """The scenario, or None when the drawn mask leaves a row empty (rejected, as it must be)."""
    from gradcheck_cli.errors import ScenarioError
    try:
        return make(**keys)
    except ScenarioError as exc:
        assert "sees no key" in str(exc), str(exc)
        return None


@st.composite
def problems(draw):
    batch, heads_kv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    heads_q = heads_kv * draw(st.integers(1, 3))
    n_q, n_k = draw(st.integers(1, 20)), draw(st.integers(1, 24))
    causal = draw(st.sampled_from(["none", "upper-left", "lower-right"]))
    window = draw(st.none() | st.tuples(st.none() | st.integers(0, 6), st.none() | st.integers(0, 6)))
    lengths = draw(st.none() | st.lists(st.integers(1, n_k), min_size=batch, max_size=batch))
    visible = masks.build_visible(batch, heads_q, n_q, n_k, causal=causal, window=window, key_lengths=lengths)
    if masks.first_empty_row(visible) is not None:
        visible = masks.build_visible(batch, heads_q, n_q, n_k)  # every row needs a key
        causal, window, lengths = "none", None, None
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    d, dv = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    q, k = rng.standard_normal((batch, heads_q, n_q, d)), rng.standard_normal((batch, heads_kv, n_k, d))
    v, g = rng.standard_normal((batch, heads_kv, n_k, dv)), rng.standard_normal((batch, heads_q, n_q, dv))
    kv_map = np.arange(heads_q) // (heads_q // heads_kv)
    return q, k, v, g, visible, kv_map, draw(st.integers(1, 9)), draw(st.integers(1, 9)), (causal, window, lengths)
