"""Packed variable-length batches (``varlen: {seqlens_q, seqlens_k}``): the visible set against an independent
per-document construction, the packed engine against attention run on each document alone (torch autograd where
installed), the arguments your code is passed, the check ``documents do not see each other`` and its hint, the
faults on the built-in engines and on your code, and the loader's messages."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradcheck_cli import checker, masks
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.ops.attention import formulas, varlen

from helpers import make, with_examples


def _independent_visible(lq, lk, causal, window):
    """The packed visible set [n_q, n_k] document by document, from FlashAttention's varlen rule: query i' of a
    document sees its key j' when j' <= i' + lk - lq (bottom-right), j' <= i' (top-left), any (none), within the
    window about that diagonal."""
    out = np.zeros((sum(lq), sum(lk)), dtype=bool)
    q0 = k0 = 0
    for a, b in zip(lq, lk):
        for i in range(a):
            for j in range(b):
                diag = i if causal == "upper-left" else i + b - a
                ok = causal == "none" or j <= diag
                if window is not None:
                    left, right = window
                    ok &= (left is None or j >= diag - left) and (right is None or j <= diag + right)
                out[q0 + i, k0 + j] = ok
        q0, k0 = q0 + a, k0 + b
    return out


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 6)), min_size=1, max_size=5),
       causal=st.sampled_from(("none", "upper-left", "lower-right")),
       window=st.one_of(st.none(), st.tuples(st.one_of(st.none(), st.integers(0, 3)),
                                             st.one_of(st.none(), st.integers(0, 3)))))
def test_the_visible_set_is_flashattentions_per_document_rule(docs, causal, window):
    lq, lk = [a for a, _ in docs], [b for _, b in docs]
    if not sum(lq) or not sum(lk):
        return
    got = masks.build_visible(1, 2, sum(lq), sum(lk), causal=causal, window=window, documents=(lq, lk))
    want = _independent_visible(lq, lk, causal, window)
    assert (got == want[None, None]).all()
    block = masks.blockwise(sum(lq), sum(lk), causal=causal, window=window, documents=(lq, lk))
    assert (block(slice(1, None), slice(2, None))[0, 0] == want[1:, 2:]).all()  # the tiled engine's blocks


SCENARIO = {"heads_q": 4, "heads_kv": 2, "d_head": 4, "mask": {"causal": "lower-right"},
            "varlen": {"seqlens_q": [3, 1, 2], "seqlens_k": [5, 2, 4]}}


def test_the_packed_engine_is_attention_on_each_document_alone():
    """O and the gradients of the packed batch equal those of each document computed as its own batch (the plain
    closed forms with the document's own lower-right causal mask): nothing crosses a boundary."""
    sc = make(**SCENARIO)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(s) for s in [(1, 4, 6, 4), (1, 2, 11, 4), (1, 2, 11, 4), (1, 4, 6, 4)])
    kv_map = np.asarray(sc.kv_map)
    o = formulas.forward(q, k, v, sc.visible, sc.scale, kv_map)
    grads = formulas.backward(q, k, v, sc.visible, sc.scale, kv_map, g)
    cu_q, cu_k = sc.documents.cu_q, sc.documents.cu_k
    for d in range(3):
        rows, keys = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        n, m = rows.stop - rows.start, keys.stop - keys.start
        vis = masks.build_visible(1, 4, n, m, causal="lower-right")
        alone = formulas.backward(q[..., rows, :], k[..., keys, :], v[..., keys, :], vis, sc.scale, kv_map,
                                  g[..., rows, :])
        np.testing.assert_allclose(o[..., rows, :], formulas.forward(q[..., rows, :], k[..., keys, :],
                                                                      v[..., keys, :], vis, sc.scale, kv_map),
                                   rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(grads.q[..., rows, :], alone.q, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(grads.k[..., keys, :], alone.k, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(grads.v[..., keys, :], alone.v, rtol=1e-12, atol=1e-13)


def test_the_packed_engine_equals_torch_autograd_of_a_loop_over_documents():
    torch = pytest.importorskip("torch")
    sc = make(**SCENARIO)
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s) for s in [(1, 4, 6, 4), (1, 2, 11, 4), (1, 2, 11, 4)]]
    g = rng.standard_normal((1, 4, 6, 4))
    leaves = [torch.tensor(x, requires_grad=True) for x in arrays]
    q, k, v = leaves
    kv = torch.as_tensor(sc.kv_map)
    out = []
    for (q0, q1), (k0, k1) in zip(zip(sc.documents.cu_q[:-1], sc.documents.cu_q[1:]),
                                  zip(sc.documents.cu_k[:-1], sc.documents.cu_k[1:])):
        lq, lk = int(q1 - q0), int(k1 - k0)
        s = sc.scale * q[:, :, q0:q1] @ k[:, kv, k0:k1].transpose(-1, -2)
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        out.append(torch.softmax(s.masked_fill(~causal, float("-inf")), -1) @ v[:, kv, k0:k1])
    o = torch.cat(out, 2)
    grads = torch.autograd.grad(o, leaves, torch.tensor(g))
    mine = formulas.backward(*arrays, sc.visible, sc.scale, np.asarray(sc.kv_map), g)
    np.testing.assert_allclose(formulas.forward(*arrays, sc.visible, sc.scale, np.asarray(sc.kv_map)),
                               o.detach(), rtol=1e-12, atol=1e-13)
    for a, b in zip((mine.q, mine.k, mine.v), grads):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_every_engine_passes_and_names_the_documents_in_its_header():
    for engine in ({}, {"engine": "tiled", "block_q": 2, "block_k": 3}):
        sc = make(**SCENARIO, **engine)
        result = checker.run_scenario(sc)
        assert result.passed, [(c.name, c.detail) for c in result.checks if not c.passed]
        assert "documents do not see each other" in {c.name for c in result.checks}
        assert sc.describe().endswith("varlen 3 docs") and (sc.n_q, sc.n_k, sc.batch) == (6, 11, 1)


RECORDER = """
import json
from gradcheck_cli.ops.attention import formulas


class Recorder:  # the closed forms, recording the keyword arguments the first forward is passed (in a file:
    def __init__(self, path):  # user code runs in a worker process)
        self.path = path

    def forward(self, q, k, v, visible, scale, kv_map, **kw):
        with open(self.path, "a") as out:
            out.write(json.dumps({n: [type(x).__name__, str(getattr(x, "dtype", "")),
                                      x.tolist() if hasattr(x, "tolist") else x] for n, x in kw.items()}) + "\\n")
        return formulas.forward(q, k, v, visible, scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        g = formulas.backward(q, k, v, visible, scale, kv_map, grad_o)
        return g.q, g.k, g.v


impl = Recorder(%r)
"""


def test_your_code_is_passed_the_cumulative_lengths_as_flashattention_names_them(tmp_path, monkeypatch):
    import json
    log = tmp_path / "kw.jsonl"
    (tmp_path / "recorder_mod.py").write_text(RECORDER % str(log))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert checker.run_scenario(make(**SCENARIO, implementation="recorder_mod:impl")).passed
    kw = json.loads(log.read_text().splitlines()[0])
    assert set(kw) == {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
    assert kw["cu_seqlens_q"] == ["ndarray", "int32", [0, 3, 4, 6]]
    assert kw["cu_seqlens_k"] == ["ndarray", "int32", [0, 5, 7, 11]]
    assert kw["max_seqlen_q"] == ["int", "", 3] and kw["max_seqlen_k"] == ["int", "", 5]


def _leaky(q, k, v, visible, scale, kv_map, **kw):
    """One causal mask over the packed axis (the documents' boundaries ignored)."""
    n, m = q.shape[-2], k.shape[-2]
    return formulas.forward(q, k, v, np.broadcast_to(masks.build_visible(1, 1, n, m, causal="lower-right"),
                                                     visible.shape), scale, kv_map)


def test_the_document_check_names_the_documents_that_see_each_other():
    sc = make(**SCENARIO)
    rng = np.random.default_rng(2)
    inputs = {"q": rng.standard_normal((1, 4, 6, 4)), "k": rng.standard_normal((1, 2, 11, 4)),
              "v": rng.standard_normal((1, 2, 11, 4))}
    kv_map, terms = np.asarray(sc.kv_map), np.ones((1, 4, 6, 4))
    right = lambda q, k, v: formulas.forward(q, k, v, sc.visible, sc.scale, kv_map)  # noqa: E731
    leaky = lambda q, k, v: _leaky(q, k, v, sc.visible, sc.scale, kv_map)  # noqa: E731
    ok = varlen.document_invariant(right, inputs, sc.documents, right(**inputs), np.random.default_rng(0), terms,
                                   "float64", 64.0)
    assert ok.passed and not ok.facts["leaks"]
    bad = varlen.document_invariant(leaky, inputs, sc.documents, leaky(**inputs), np.random.default_rng(0), terms,
                                    "float64", 64.0)
    assert not bad.passed
    # packed lower-right causal (n_q 6, n_k 11): query row 3 (document 1) sees keys up to 8, row 0 up to 5
    assert (0, 1) in bad.facts["leaks"] and (0, 2) in bad.facts["leaks"]
    assert "document 0's keys leak into document" in bad.detail


@pytest.mark.parametrize("name, words", [("broken-packed-causal", "document 0's keys reach document"),
                                         ("broken-single-query-path", "document 0's keys reach document 2")])
def test_the_broken_examples_fail_and_the_hint_speaks_of_documents(name, words):
    pytest.importorskip("torch")
    from gradcheck_cli import scenario

    from helpers import ROOT
    sc = next(s for s in scenario.load(ROOT / "examples/varlen.yaml") if s.name == name)
    result = checker.run_scenario(sc)
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert {"forward agrees with the reference", "documents do not see each other"} <= failed
    assert any(words in h for h in result.hints), result.hints


def test_the_top_left_example_fails_the_reference_checks_and_the_hint_names_the_alignment():
    pytest.importorskip("torch")
    from gradcheck_cli import scenario

    from helpers import ROOT
    sc = next(s for s in scenario.load(ROOT / "examples/varlen.yaml") if s.name == "broken-top-left")
    result = checker.run_scenario(sc)
    failed = {c.name for c in result.checks if c.verdict == "fail"}
    assert failed == {"forward agrees with the reference", "backward agrees with the reference"}
    assert any("aligns each document's causal mask upper-left" in h for h in result.hints), result.hints


@pytest.mark.parametrize("fault", sorted(varlen.FAULTS))
def test_each_fault_is_caught_on_your_numpy_code(fault):
    sc = with_examples(**SCENARIO, implementation="varlen_attention:numpy_attention")
    assert checker.run_scenario(sc).passed
    assert fault in checker.applicable_faults(sc) and varlen.why_not(sc, fault) is None
    failed = {c.name for c in checker.run_scenario(sc, (fault,)).checks if c.verdict == "fail"}
    assert "forward agrees with the reference" in failed and failed <= set(varlen.FAULTS[fault].caught_by)


def test_the_faults_apply_only_where_they_change_something():
    plain = make(heads_q=2, d_head=4, n_q=4)
    assert not {f for f in checker.applicable_faults(plain) if f.startswith("varlen")}
    one = make(heads_q=2, d_head=4, varlen={"seqlens_q": [4]}, mask={"causal": "lower-right"})
    assert "one document" in varlen.why_not(one, "varlen-packed-causal")
    assert "no document of one query" in varlen.why_not(one, "varlen-single-query")
    square = make(heads_q=2, d_head=4, varlen={"seqlens_q": [2, 3]}, mask={"causal": "lower-right"})
    assert "alignments agree" in varlen.why_not(square, "varlen-top-left")


@pytest.mark.parametrize("keys, key, words", [
    ({"varlen": {"seqlens_q": [3, 2], "seqlens_k": [2, 2]}, "mask": {"causal": "lower-right"}}, "mask.causal",
     "document 0 (3 queries: rows 0-2; 2 keys: 0-1): its query 0 (packed row 0) sees no key"),
    ({"varlen": {"seqlens_q": [3, 2]}, "batch": 2}, "batch", "a packed batch (varlen) has batch 1"),
    ({"varlen": {"seqlens_q": [3, 2]}, "n_q": 4}, "n_q", "varlen.seqlens_q adds up to 5"),
    ({"varlen": {"seqlens_q": [3, 2], "seqlens_k": [3]}}, "varlen.seqlens_k", "has 1 documents but seqlens_q has 2"),
    ({"varlen": {"seqlens_k": [3]}}, "varlen.seqlens_k", "without varlen.seqlens_q"),
    ({"varlen": {"seqlens_q": [2, 1], "seqlens_k": [3, 0]}}, "varlen.seqlens_k", "document 1 has 1 query and no key"),
    ({"varlen": {"seqlens_q": [0]}}, "varlen.seqlens_q", "adds up to 0"),
])
def test_the_loader_refuses_a_wrong_packed_batch_naming_the_key(keys, key, words):
    with pytest.raises(ScenarioError) as info:
        make(heads_q=2, d_head=4, **keys)
    assert info.value.key.endswith(key) and words in str(info.value)


def test_varlen_is_attentions_alone():
    with pytest.raises(ScenarioError, match="does not apply to op attention-projections"):
        make(op="attention-projections", d_head=4, d_model=8, varlen={"seqlens_q": [2, 2]})


BAD_DOCUMENT = """
from gradcheck_cli.ops.attention import formulas


class Bad:  # dK of document 1 scaled by 1.5: a per-document bug in a varlen backward
    def forward(self, q, k, v, visible, scale, kv_map, **kw):
        return formulas.forward(q, k, v, visible, scale, kv_map)

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, *, cu_seqlens_k, **kw):
        g = formulas.backward(q, k, v, visible, scale, kv_map, grad_o)
        dk = g.k.copy()
        dk[..., cu_seqlens_k[1]:cu_seqlens_k[2], :] *= 1.5
        return g.q, dk, g.v


impl = Bad()
"""


def test_the_localisation_names_the_document_where_the_errors_sit(tmp_path, monkeypatch):
    (tmp_path / "bad_document.py").write_text(BAD_DOCUMENT)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = checker.run_scenario(make(**SCENARIO, implementation="bad_document:impl"))
    failed = {(c.name, c.tensor) for c in result.checks if c.verdict == "fail"}
    assert failed == {("gradient k", "k"), ("backward agrees with the reference", "k")}
    grad_k = next(c for c in result.checks if c.name == "gradient k")
    classes = {c["label"]: c["out_of_tolerance"] for c in grad_k.diagnosis["classes"]}
    # document 1 has keys 5-6 of 2 KV heads x 4 features: all 16 out, the other documents' none
    assert classes["document 1's keys"] == 16 == grad_k.diagnosis["out_of_tolerance"]
    assert classes["document 0's keys"] == classes["document 2's keys"] == 0
    from gradcheck_cli.ops.attention.hints import diagnosis
    structure, _ = diagnosis(make(**SCENARIO))
    single = structure["q"].classes["queries of one-query documents"]  # document 1: packed row 3
    assert single.shape == (1, 4, 6) and single[0, 0].tolist() == [False, False, False, True, False, False]


# ALiBi's distance form without a causal mask (under one, a document's shift of positions is a constant per row,
# which the softmax removes: the test could not fail); T5's buckets under the causal mask
@pytest.mark.parametrize("stage, causal", [({"alibi": {"form": "distance"}}, "none"),
                                           ({"relative_bias": {"buckets": 8, "max_distance": 16}}, "lower-right")])
def test_alibi_and_t5_take_each_documents_own_positions(stage, causal):
    """In a packed batch the position-dependent stages (ALiBi, T5's buckets) are each document's own, as
    FlashAttention's varlen takes them: the packed O and gradients equal each document run alone with the stage
    built for its own lengths (and differ from the packed axis' positions)."""
    from gradcheck_cli.ops.attention import stages as score_stages
    sc = make(**{**SCENARIO, "mask": {"causal": causal}}, **stage)
    packed = score_stages.from_scenario(sc)
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal(s) for s in [(1, 4, 6, 4), (1, 2, 11, 4), (1, 2, 11, 4), (1, 4, 6, 4)])
    kv_map = np.asarray(sc.kv_map)
    o = formulas.forward(q, k, v, sc.visible, sc.scale, kv_map, stages=packed)
    grads = formulas.backward(q, k, v, sc.visible, sc.scale, kv_map, g, stages=packed)
    cu_q, cu_k = sc.documents.cu_q, sc.documents.cu_k
    for d in range(3):
        rows, keys = slice(cu_q[d], cu_q[d + 1]), slice(cu_k[d], cu_k[d + 1])
        n, m = rows.stop - rows.start, keys.stop - keys.start
        alone_sc = make(heads_q=4, heads_kv=2, d_head=4, n_q=int(n), n_k=int(m), mask={"causal": causal}, **stage)
        alone = score_stages.from_scenario(alone_sc)
        vis = masks.build_visible(1, 4, n, m, causal=causal)
        sub = (q[..., rows, :], k[..., keys, :], v[..., keys, :], vis, sc.scale, kv_map)
        np.testing.assert_allclose(o[..., rows, :], formulas.forward(*sub, stages=alone), rtol=1e-13, atol=1e-14)
        mine = formulas.backward(*sub, g[..., rows, :], stages=alone)
        np.testing.assert_allclose(grads.q[..., rows, :], mine.q, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(grads.k[..., keys, :], mine.k, rtol=1e-12, atol=1e-13)
    packed_axis = make(**{**SCENARIO, "mask": {"causal": causal}, "n_q": 6, "n_k": 11, "varlen": None}, **stage)
    on_packed_axis = formulas.forward(q, k, v, sc.visible, sc.scale, kv_map,
                                      stages=score_stages.from_scenario(packed_axis))
    assert np.abs(on_packed_axis - o).max() > 1e-3  # the packed axis' positions give another O on these inputs


def test_alibi_on_the_packed_axis_is_caught():
    pytest.importorskip("torch")
    from gradcheck_cli import scenario

    from helpers import ROOT
    scs = {s.name: s for s in scenario.load(ROOT / "examples/varlen.yaml") if "alibi" in s.name}
    assert checker.run_scenario(scs["mine-torch-alibi"]).passed
    failed = {c.name for c in checker.run_scenario(scs["broken-alibi-packed-positions"]).checks if c.verdict == "fail"}
    assert "forward agrees with the reference" in failed


def test_a_scenarios_varlen_replaces_the_defaults_whole():
    """seqlens_q and seqlens_k go together: a scenario's varlen is not merged key by key over the defaults' (a
    mask is), so its own seqlens_k default to its own seqlens_q."""
    from gradcheck_cli import scenario
    text = ("defaults: {heads_q: 2, d_head: 4, varlen: {seqlens_q: [3, 1, 4, 2], seqlens_k: [5, 3, 4, 6]}}\n"
            "scenarios: [{name: a}, {name: b, varlen: {seqlens_q: [3, 1, 6]}}]\n")
    a, b = scenario.loads(text)
    assert a.documents.seqlens_k == (5, 3, 4, 6) and (a.n_q, a.n_k) == (10, 18)
    assert b.documents.seqlens_k == (3, 1, 6) and (b.n_q, b.n_k) == (10, 10)


SKIPS_DOCUMENTS = """
import numpy as np
from gradcheck_cli.ops.attention import formulas


class Skips:  # a loop over the documents that stops after the first: the others' rows stay 0
    def forward(self, q, k, v, visible, scale, kv_map, *, cu_seqlens_q, cu_seqlens_k, **kw):
        o = np.zeros(q.shape[:-1] + (v.shape[-1],))
        q1, k1 = int(cu_seqlens_q[1]), int(cu_seqlens_k[1])
        o[:, :, :q1] = formulas.forward(q[:, :, :q1], k[:, :, :k1], v[:, :, :k1], visible[:, :, :q1, :k1], scale,
                                        kv_map)
        return o

    def backward(self, q, k, v, visible, scale, kv_map, grad_o, **kw):
        g = formulas.backward(q, k, v, visible, scale, kv_map, grad_o)
        return g.q, g.k, g.v


impl = Skips()
"""


def test_documents_left_at_zero_are_named_not_the_softmax(tmp_path, monkeypatch):
    (tmp_path / "skips_documents.py").write_text(SKIPS_DOCUMENTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    result = checker.run_scenario(make(**SCENARIO, implementation="skips_documents:impl"))
    assert "forward agrees with the reference" in {c.name for c in result.checks if c.verdict == "fail"}
    assert any("every output row of documents 1, 2 at 0" in h for h in result.hints), result.hints
    assert not any("normalisation" in h for h in result.hints), result.hints
