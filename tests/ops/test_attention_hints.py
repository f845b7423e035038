"""Hints fire on their evidence only: a table of distinct realistic bugs (tests/buggy_attention.py), each
run through the checker as a user's implementation; the hint of its cause must be there and no other
cause's hint may be. Bugs with no specific hint must get none of them. And every verdict is right:
each bug fails (or, for correct float32-internal code, is inconclusive with the precision hint)."""
import pytest

from gradcheck_cli import checker

from helpers import make

#: A phrase that only the hint of each cause contains.
PHRASES = {
    "precision": "computes internally in about float32",
    "forward-mask": "the forward lets hidden keys reach O",
    "window-off-by-one": "`mask-forward-window-left+1`",
    "softmax-axis": "`softmax-over-queries`",
    "causal-alignment": "causal mask aligned upper-left",
    "kv-layout": "maps query heads to KV heads interleaved",
    "batch-mixing": "mixes batch elements",
    "missing-keys": "never reads key row",
    "normalisation": "do not sum to 1",
    "backward-mask": "the backward ignores or misapplies the visible set",
    "swapped": "G_K and G_V are swapped",
    "row-sum": "row-sum term",
    "scale": "scale factor in the backward",
    "factor-q": "constant factor on dQ alone",
    "factor-k": "constant factor on dK alone",
    "factor-v": "constant factor on dV alone",
    "gqa": "GQA reduction",
    "nondeterminism": "not deterministic",
    "mask-convention": "reads visible as a drop mask",
    "layout-convention": "set convention: {layout: bnhd}",
    "additive-convention": "set convention: {mask: additive}",
    "additive-min-convention": "set convention: {mask: additive-min}",
    "shared-convention": "set convention: {mask_heads: shared}",
    "scale-convention": "set convention: {scale: omitted}",
}

GQA = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=7, d_head=4, mask={"causal": "lower-right",
                                                                       "key_lengths": [7, 6]})
CACHE = dict(batch=2, heads_q=4, heads_kv=2, n_q=6, n_k=20, d_head=8, mask={"causal": "lower-right"})
SQUARE = dict(batch=2, heads_q=2, heads_kv=2, n_q=6, n_k=6, d_head=4, mask={"causal": "lower-right"})
GQA_SQUARE = dict(SQUARE, heads_q=4)
PLAIN = dict(batch=2, heads_q=2, heads_kv=2, n_q=6, n_k=9, d_head=4)
TAIL = dict(batch=2, heads_q=2, heads_kv=1, n_q=5, n_k=11, d_head=4)
WINDOW = dict(batch=2, heads_q=2, n_q=12, d_head=8, mask={"causal": "lower-right", "window": [3, 0]})
CACHE_6x10 = dict(batch=2, heads_q=2, n_q=6, n_k=10, d_head=8, mask={"causal": "lower-right"})
SQUARE_12 = dict(batch=2, heads_q=2, n_q=12, d_head=8, mask={"causal": "lower-right"})
PADDED = dict(batch=2, heads_q=2, n_q=6, n_k=9, d_head=4, mask={"key_lengths": [7, 5]})

#: (bug in tests/buggy_attention.py, scenario, dtype, expected cause or None for "no specific hint")
TABLE = [
    ("softmax_rowsum", GQA, "float64", "row-sum"),
    ("scale_missing", GQA, "float64", "scale"),
    ("scale_twice", PLAIN, "float64", "scale"),
    ("gqa_overwrite", GQA, "float64", "gqa"),
    ("gqa_first_only", CACHE, "float64", "gqa"),
    ("mask_ignored", GQA, "float64", "forward-mask"),
    ("mask_backward_only", GQA, "float64", "backward-mask"),
    ("dv_unmasked", CACHE, "float64", "backward-mask"),
    ("dk_times_1001", GQA, "float64", "factor-k"),
    ("dk_times_1001", CACHE, "float32", "factor-k"),
    ("dv_times_half", GQA, "float64", "factor-v"),
    ("dq_times_1001", PLAIN, "float64", "factor-q"),
    ("swap_dk_dv", GQA, "float64", "swapped"),
    ("online_softmax_no_rescale", PLAIN, "float64", "normalisation"),
    ("causal_upper_left", CACHE, "float64", "causal-alignment"),
    ("kv_interleaved", CACHE, "float64", "kv-layout"),
    ("batch_mixing_mean", PLAIN, "float64", "batch-mixing"),
    ("dropped_tail_block", TAIL, "float64", "missing-keys"),
    ("transposed_dv", SQUARE, "float64", None),
    ("transposed_dv", GQA_SQUARE, "float64", None),          # every KV head shared: still no GQA hint
    ("dv_unmasked", GQA_SQUARE, "float64", "backward-mask"),
    ("additive_dv", GQA, "float64", None),
    ("float32_internal_correct", GQA, "float64", "precision"),
    ("float32_internal_correct", CACHE, "float64", "precision"),
    # written by an independent review (tests/buggy_attention_more.py)
    ("more:drop_mask_convention", PADDED, "float64", "mask-convention"),
    ("more:window_one_too_wide", WINDOW, "float64", "window-off-by-one"),  # named by its fingerprint
    ("more:causal_offset_swapped", CACHE_6x10, "float64", "forward-mask"),
    ("more:tiled_local_mask_index", SQUARE_12, "float64", "forward-mask"),
    ("more:multiplicative_mask", GQA, "float64", "forward-mask"),
    ("more:softmax_query_axis", PLAIN, "float64", "softmax-axis"),  # named by its fingerprint
    ("more:stale_workspace", GQA, "float64", "nondeterminism"),
    ("more:rowsum_unmasked_p", GQA, "float64", "row-sum"),
    ("more:dk_wrong_kv_head", GQA, "float64", None),
    ("more:backward_transposed_mask", GQA, "float64", None),
    ("more:dq_layout_reshape", GQA, "float64", None),
    # correct code written for another calling convention (tests/convention_attention.py), run under the default
    ("conv:bnhd", GQA, "float64", "layout-convention"),            # the call fails: shapes do not fit
    ("conv:bnhd", dict(batch=2, heads_q=6, n_q=6, d_head=4), "float64", "layout-convention"),  # O is wrong
    ("conv:drop", PADDED, "float64", "mask-convention"),
    ("conv:drop", GQA, "float32", "mask-convention"),               # a row sees no key: O is NaN there
    ("conv:additive", GQA, "float64", "additive-convention"),
    ("conv:additive_min", CACHE, "float64", "additive-min-convention"),  # it compares with finfo.min
    ("conv:shared", GQA, "float64", "shared-convention"),
    ("conv:no_scale", GQA, "float64", "scale-convention"),
    ("conv:interleaved", CACHE, "float64", "kv-layout"),
]


def _run(bug, shape, dtype, faults=()):
    module, _, name = bug.rpartition(":")
    module = {"": "buggy_attention", "more": "buggy_attention_more", "conv": "convention_attention"}[module]
    sc = make(**shape, dtype=dtype, implementation=f"{module}:{name}")
    return checker.run_scenario(sc, faults)


@pytest.mark.parametrize("bug,shape,dtype,cause", TABLE, ids=[f"{b.split(':')[-1]}-{d}-{i}"
                                                               for i, (b, _, d, _) in enumerate(TABLE)])
def test_each_hint_fires_on_its_cause_and_no_other(bug, shape, dtype, cause):
    result = _run(bug, shape, dtype)
    text = " | ".join(result.hints)
    assert result.verdict == ("inconclusive" if cause == "precision" else "fail"), (result.verdict, text)
    if cause is not None:
        assert PHRASES[cause] in text, text
    for other, phrase in PHRASES.items():
        if other != cause:
            assert phrase not in text, (other, text)


def test_the_table_holds_at_least_fifteen_distinct_bugs():
    assert len({bug for bug, *_ in TABLE}) >= 25 and len({c for *_, c in TABLE if c}) >= 15


@pytest.mark.parametrize("scale", [50.0, 2000.0])
def test_a_correct_implementation_at_a_large_scale(scale):
    """Terms under ~1e-154 (keys almost no query weighs) must not make the allowance 0."""
    result = checker.run_scenario(make(**dict(SQUARE_12, d_head=16), scale=scale,
                                       implementation="buggy_attention:correct"))
    assert result.verdict == "pass" and result.hints == (), [(c.name, c.detail) for c in result.checks
                                                               if not c.passed]


def test_dropout_left_on_is_named_as_nondeterminism_and_nothing_else():
    pytest.importorskip("torch")
    sc = make(**GQA, backend="torch", implementation="buggy_torch_attention_more:dropout_left_on")
    result = checker.run_scenario(sc)
    assert result.verdict == "fail" and len(result.hints) == 1 and PHRASES["nondeterminism"] in result.hints[0]
    assert all("from call to call" in c.detail for c in result.checks if c.kind == "gradient" and not c.passed)


def test_a_correct_implementation_gets_no_hint():
    for shape in (GQA, CACHE, SQUARE, PLAIN, TAIL):
        result = _run("correct", shape, "float64")
        assert result.verdict == "pass" and result.hints == (), [(c.name, c.detail) for c in result.checks
                                                                   if not c.passed]


@pytest.mark.parametrize("bug", ["nondeterministic_backward", "nondeterministic_backward_rel"])
def test_a_backward_that_changes_from_call_to_call_is_reported(bug):
    result = _run(bug, GQA, "float64")
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert "deterministic" in failed and result.verdict == "fail"
    assert not any(PHRASES["backward-mask"] in h for h in result.hints)
    # the hint names what differs from Check.facts (the backward's gradients, not O)
    (hint,) = [h for h in result.hints if "not deterministic" in h]
    assert "its d" in hint and "its O" not in hint, hint


def test_nondet_tol_admits_a_backward_that_varies_within_it():
    sc = make(**GQA, implementation="buggy_attention:nondeterministic_backward_rel", check={"nondet_tol": 1e-6})
    (det,) = [c for c in checker.run_scenario(sc).checks if c.name == "deterministic"]
    assert det.passed and det.max_abs_error > 0


@pytest.mark.parametrize("bug,tensor", [("inplace_grad_o", "grad_o"), ("inplace_input", "q"),
                                        ("inplace_input_used", "q")])
def test_an_implementation_that_changes_its_arguments_is_reported_naming_them(bug, tensor):
    result = _run(bug, GQA, "float64")
    bad = [c for c in result.checks if c.verdict == "fail"]
    assert result.verdict == "fail" and any(c.tensor == tensor and "in place" in c.detail for c in bad), \
        [(c.name, c.tensor, c.detail) for c in bad]


TORCH = [("dk_times_1001", "float32", "factor-k"), ("softmax_rowsum", "float64", "row-sum"),
         ("mask_ignored", "float64", "forward-mask"), ("float32_internal_correct", "float64", "precision")]


@pytest.mark.parametrize("bug,dtype,cause", TORCH)
def test_torch_flavour_bugs_get_the_right_verdict_and_hint(bug, dtype, cause):
    pytest.importorskip("torch")
    sc = make(**GQA, dtype=dtype, backend="torch", implementation=f"buggy_torch_attention:{bug}")
    result = checker.run_scenario(sc)
    text = " | ".join(result.hints)
    assert result.verdict == ("inconclusive" if cause == "precision" else "fail"), (result.verdict, text)
    assert PHRASES[cause] in text, text
    assert not [p for c, p in PHRASES.items() if c != cause and p in text], text


@pytest.mark.parametrize("bug,tensor,dtypes", [("inplace_grad_o", "grad_o", ("float64", "float32", "bfloat16")),
                                               # q x 1.001 rounds back to q in bfloat16
                                               ("inplace_input", "q", ("float64", "float32"))])
def test_torch_flavour_mutation_is_reported_and_cannot_rewrite_the_loss(bug, tensor, dtypes):
    pytest.importorskip("torch")
    for dtype in dtypes:
        sc = make(**GQA, dtype=dtype, backend="torch", implementation=f"buggy_torch_attention:{bug}")
        result = checker.run_scenario(sc)
        assert result.verdict == "fail", (dtype, [(c.name, c.verdict) for c in result.checks])
        assert any(c.tensor == tensor and "in place" in c.detail for c in result.checks if c.verdict == "fail")


def test_torch_flavour_nondeterminism_is_reported():
    pytest.importorskip("torch")
    sc = make(**GQA, backend="torch", implementation="buggy_torch_attention:nondeterministic_backward")
    assert "deterministic" in {c.name for c in checker.run_scenario(sc).checks if c.verdict == "fail"}


@pytest.mark.parametrize("dtype,scale", [("float16", 3.0), ("float32", 30.0)])
def test_an_overflow_the_engine_avoids_is_blamed_on_the_implementation(dtype, scale):
    pytest.importorskip("torch")
    sc = make(**GQA, dtype=dtype, scale=scale, backend="torch",
              implementation="buggy_torch_attention_more:no_max_subtraction")
    result = checker.run_scenario(sc)
    assert result.verdict == "fail" and result.hints and "subtract each row's maximum" in result.hints[0]
