"""Visible sets against the element-by-element rules, and the empty-row rejection."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from gradcheck_cli import masks

from reference import visible_loops


@given(st.integers(1, 2), st.integers(1, 6), st.integers(1, 8), st.sampled_from(masks.CAUSAL),
       st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 4)),
                                      st.one_of(st.none(), st.integers(0, 4)))),
       st.data())
def test_build_visible_matches_the_rules(batch, n_q, n_k, causal, window, data):
    key_lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(0, n_k), min_size=batch, max_size=batch)))
    got = masks.build_visible(batch, 2, n_q, n_k, causal=causal, window=window, key_lengths=key_lengths)
    np.testing.assert_array_equal(got, visible_loops(batch, 2, n_q, n_k, causal, window, key_lengths))


def test_causal_alignments_for_a_query_block_against_a_cache():
    lr = masks.build_visible(1, 1, 2, 4, causal="lower-right")[0, 0]
    ul = masks.build_visible(1, 1, 2, 4, causal="upper-left")[0, 0]
    np.testing.assert_array_equal(lr, [[1, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(ul, [[1, 0, 0, 0], [1, 1, 0, 0]])


def test_window_follows_flash_attention_window_size():
    # window (1, 0) with causal lower-right on a square: each query sees itself and one key to the left
    vis = masks.build_visible(1, 1, 4, 4, causal="lower-right", window=(1, 0))[0, 0]
    np.testing.assert_array_equal(vis, [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]])


def test_explicit_mask_is_anded():
    explicit = np.array([[True, False, True]])
    vis = masks.build_visible(1, 1, 1, 3, key_lengths=[2], explicit=explicit)
    np.testing.assert_array_equal(vis[0, 0], [[True, False, False]])


def test_first_empty_row_names_batch_head_row():
    vis = np.ones((2, 3, 4, 5), dtype=bool)
    assert masks.first_empty_row(vis) is None
    vis[1, 2, 3] = False
    assert masks.first_empty_row(vis) == (1, 2, 3)


def test_kv_rows_seen_respects_the_head_map():
    vis = np.zeros((1, 2, 1, 3), dtype=bool)
    vis[0, 0, 0, 0] = True  # head 0 sees key 0
    vis[0, 1, 0, 2] = True  # head 1 sees key 2
    seen = masks.kv_rows_seen(vis, np.array([0, 0]), 1)
    np.testing.assert_array_equal(seen[0, 0], [True, False, True])
    seen = masks.kv_rows_seen(vis, np.array([0, 1]), 2)
    np.testing.assert_array_equal(seen[0], [[True, False, False], [False, False, True]])
