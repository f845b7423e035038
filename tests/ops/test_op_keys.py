"""Each op's YAML keys: bad values are rejected naming the file, line and key (the keys are declared
by each op module in gradcheck_cli/ops/)."""
import pytest

from helpers import assert_rejected

BAD_OP_KEYS = [
    ("op: rmsnorm\n    n: 3\n", 2, "scenarios[0].d_model", "is required"),
    ("op: rmsnorm\n    d_model: 4\n    eps: -1\n", 5, "scenarios[0].eps", "must be >= 0"),
    ("op: rmsnorm\n    d_model: 4\n    heads_q: 2\n", 5, "scenarios[0].heads_q", "does not apply to op rmsnorm"),
    ("op: rmsnorm\n    d_model: 4\n    d_ff: 2\n", 5, "scenarios[0].d_ff", "it is a key of swiglu"),
    ("op: rope\n    n: 3\n    d_head: 5\n", 5, "scenarios[0].d_head", "must be even"),
    ("op: rope\n    n: 3\n    d_head: 4\n    rotary_dim: 6\n", 6, "scenarios[0].rotary_dim", "larger than d_head"),
    ("op: rope\n    n: 3\n    d_head: 4\n    layout: diagonal\n", 6, "scenarios[0].layout", "expected one of"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 0\n", 5, "scenarios[0].d_ff", "must be >= 1"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 2\n    dtype: float16\n", 6, "scenarios[0].dtype", "expected one of"),
    ("op: swiglu\n    d_model: 4\n    d_ff: 2\n    check: {colouring: true}\n", 6, "scenarios[0].check.colouring",
     "no independent output blocks"),
    ("op: logit-scale\n    draws: 200\n    implementation: a:b\n", 5, "scenarios[0].implementation",
     "does not apply to op logit-scale"),
]


@pytest.mark.parametrize("extra, line, key, words", BAD_OP_KEYS, ids=[b[2] + ":" + b[3] for b in BAD_OP_KEYS])
def test_bad_op_keys_name_file_line_and_key(extra, line, key, words):
    assert_rejected(f"scenarios:\n  - name: s\n    {extra}", line, key, words)


MORE_BAD = [
    ("op: attention-projections\n    n_q: 3\n    d_head: 2\n    d_model: 4\n    n_k: 5\n", 7, "scenarios[0].n_k",
     "n_k must equal n_q"),
    ("op: attention-projections\n    n_q: 3\n    d_head: 2\n    d_model: 4\n    source: both\n", 7,
     "scenarios[0].source", "expected one of"),
    ("op: block\n    n_q: 3\n    d_head: 4\n    d_model: 4\n", 2, "scenarios[0].d_ff", "is required"),
    ("op: block\n    n_q: 3\n    d_head: 3\n    d_model: 4\n    d_ff: 4\n", 5, "scenarios[0].d_head", "must be even"),
    ("op: infonce\n    dim: 4\n    hard_negatives: -1\n", 5, "scenarios[0].hard_negatives", "must be >= 0"),
    ("op: infonce\n    dim: 4\n    temperature: 0\n", 5, "scenarios[0].temperature", "must be > 0"),
    ("op: infonce\n    dim: 4\n    in_batch: yes please\n", 5, "scenarios[0].in_batch", "expected true or false"),
    ("op: infonce\n    dim: 4\n    batch: 1\n", 5, "scenarios[0].batch", "at least one negative"),
    ("op: logit-scale\n    correlation: 1.0\n", 4, "scenarios[0].correlation", "must be in [0, 1)"),
    ("op: logit-scale\n    d_heads: [8, 8]\n", 4, "scenarios[0].d_heads[1]", "listed twice"),
    ("op: logit-scale\n    draws: 10\n", 4, "scenarios[0].draws", "at least 100"),
]


@pytest.mark.parametrize("extra, line, key, words", MORE_BAD, ids=[b[2] + ":" + b[3] for b in MORE_BAD])
def test_more_bad_op_keys(extra, line, key, words):
    test_bad_op_keys_name_file_line_and_key(extra, line, key, words)
