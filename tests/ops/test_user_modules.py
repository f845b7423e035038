"""The module form of ``implementation:`` (factory, weights, call): a user's torch or flax module checked with
its weights (implementation/modules.py, the flavours' from_module). Bad forms are refused at load with the
key named; what only the built module can tell (a parameter that does not exist, a shape that does not fit,
a size the scenario lacks) fails the ``implementation runs`` row with one clear message."""
import numpy as np
import pytest
import yaml

from gradcheck_cli import checker, scenario
from gradcheck_cli.errors import ScenarioError
from gradcheck_cli.implementation import modules

from helpers import ROOT

MLP = {"name": "m", "op": "swiglu", "n": 3, "d_model": 4, "d_ff": 6, "backend": "torch",
       "implementation": {"factory": "torch_ops:SwiGLU",
                          "weights": {"gate.weight": "w1.T", "up.weight": "w3.T", "down.weight": "w2.T"}}}


def _load(doc):
    if doc.get("backend") == "torch":  # the loader refuses backend: torch where torch is not installed
        pytest.importorskip("torch")
    return scenario.loads(yaml.safe_dump({"scenarios": [doc]}, sort_keys=False), base_dir=ROOT / "examples")[0]


def _with(**changes):
    impl = {**MLP["implementation"], **changes.pop("implementation", {})}
    return {**MLP, **changes, "implementation": impl}


def _rejected(doc, *words):
    if doc.get("backend") == "torch":
        pytest.importorskip("torch")
    with pytest.raises(ScenarioError) as err:
        _load(doc)
    text = str(err.value)
    assert all(w in text for w in words), text
    return err.value


@pytest.mark.parametrize("text, tensors", [
    ("w1", ("w1",)), (" w1.T ", ("w1",)), ("concat(w_q.T, w_k.T, w_v.T)", ("w_q", "w_k", "w_v")),
    ("concat(a, concat(b, c)).T", ("a", "b", "c"))])
def test_expressions_parse_and_print_back(text, tensors):
    e = modules.parse_expr(text)
    assert str(e) == text.strip() and e.tensors() == tensors


@pytest.mark.parametrize("text", ["", "w1.T.T.", "concat(w1", "w1 w2", "concat()", "w1.X", "3"])
def test_bad_expressions_are_refused(text):
    with pytest.raises(ValueError):
        modules.parse_expr(text)


def test_an_expression_evaluates_to_the_fused_weight():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(6.0, 12.0).reshape(2, 3)
    out = modules.parse_expr("concat(a.T, b.T)").evaluate({"a": a, "b": b}, lambda t: t.swapaxes(-1, -2),
                                                          lambda ts: np.concatenate(ts, 0))
    np.testing.assert_array_equal(out, np.concatenate([a.T, b.T]))


def test_the_mapping_form_resolves_call_to_the_unmapped_tensors():
    sc = _load(MLP)
    assert sc.implementation == "torch_ops:SwiGLU"
    assert sc.module.call == ("x",) and sc.module.mapped == ("w1", "w3", "w2")


@pytest.mark.parametrize("doc, words", [
    (_with(implementation={"weight": {}}), ("unknown key 'weight'", "did you mean 'weights'")),
    ({**MLP, "implementation": {"weights": {"gate.weight": "w1.T"}}}, ("needs 'factory",)),
    (_with(implementation={"weights": {"gate.weight": "concat(w1"}}), ("closing parenthesis", "gate.weight")),
    (_with(implementation={"weights": {"gate.weight": "w4.T", "up.weight": "w3.T", "down.weight": "w2.T"}}),
     ("'w4' is not a tensor", "did you mean 'w")),
    (_with(implementation={"weights": {"gate.weight": "w1.T", "up.weight": "w3.T"}, "call": ["x"]}),
     ("w2", "neither")),
    (_with(implementation={"call": ["x", "w1"]}), ("mapped to a weight and passed in call",)),
    (_with(implementation={"call": ["xx"]}), ("'xx' is not a tensor or argument", "did you mean 'x'")),
    (_with(implementation={"call": "x"}), ("a list of names",)),
    (_with(backend="numpy"), ("torch or JAX module", "backend: torch")),
    ({"name": "a", "n_q": 3, "d_head": 2, "backend": "torch",
      "implementation": {"factory": "torch_ops:SwiGLU", "weights": {}}}, ("applies to ops with weights",)),
])
def test_bad_mapping_forms_are_refused_naming_the_key(doc, words):
    error = _rejected(doc, *words)
    assert error.line and "implementation" in (error.key or "")


def _failure(doc) -> str:
    result = checker.run_scenario(_load(doc))
    assert result.verdict == "fail"
    (row,) = [c for c in result.checks if c.name == "implementation runs"]
    return row.detail


def test_a_correct_torch_module_passes_and_its_unmapped_parameter_is_listed_frozen():
    pytest.importorskip("torch")
    result = checker.run_scenario(_load(MLP))
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert {c.tensor for c in result.checks if c.name.startswith("gradient")} == {"x", "w1", "w3", "w2"}
    (row,) = [c for c in result.checks if c.name == "module parameters"]
    assert "gate.weight <- w1.T" in row.detail and "frozen" in row.detail and "scale" in row.detail


@pytest.mark.parametrize("changes, words", [
    ({"weights": {"gate.wieght": "w1.T", "up.weight": "w3.T", "down.weight": "w2.T"}},
     ("no parameter 'gate.wieght'", "did you mean 'gate.weight'")),
    ({"weights": {"gate.weight": "w1", "up.weight": "w3.T", "down.weight": "w2.T"}}, ("did you mean w1.T?",)),
    ({"factory": "torch_ops:rmsnorm"}, ("asks for 'x'",)),
    ({"factory": "torch_ops:swiglu"}, ("asks for 'x'",)),
])
def test_what_only_the_module_can_tell_fails_the_implementation_row_clearly(changes, words):
    pytest.importorskip("torch")
    detail = _failure(_with(implementation=changes))
    assert all(w in detail for w in words), detail


def test_a_factory_missing_from_its_module_is_bad_input():
    pytest.importorskip("torch")
    doc = _with(implementation={"factory": "torch_ops:rmsnorm_module_missing"})
    with pytest.raises(ScenarioError, match="rmsnorm_module_missing"):  # refused before any run
        checker.run_scenario(_load(doc))


def test_a_factory_that_returns_no_module_is_named(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "not_a_module.py").write_text("def make(d_model):\n    return [d_model]\n")
    doc = {**_with(implementation={"factory": "not_a_module:make"})}
    result = checker.run_scenario(scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0])
    (row,) = [c for c in result.checks if c.name == "implementation runs"]
    assert "must return a torch.nn.Module, got list" in row.detail


def test_negative_controls_are_detected_on_a_module():
    pytest.importorskip("torch")
    cells = checker.negative_controls([_load(MLP)])
    assert cells and {c.status for c in cells} == {"detected"}


def test_a_jax_function_with_its_params_pytree_is_checked_with_its_weights():
    pytest.importorskip("jax")
    doc = {**MLP, "backend": "jax", "implementation": {
        "factory": "jax_ops:swiglu_with_params",
        "weights": {"mlp.gate": "w1", "mlp.up": "w3", "mlp.down": "w2"}}}
    result = checker.run_scenario(_load(doc))
    assert result.verdict == "pass", [(c.name, c.detail) for c in result.checks if not c.passed]
    assert any(c.name == "compiled once per shape" for c in result.checks)


def test_the_factory_gets_the_swept_sizes():
    pytest.importorskip("torch")
    doc = {"scenarios": [{**MLP, "sweep": {"d_model": [4, 6], "d_ff": [3]}}]}
    scenarios = scenario.loads(yaml.safe_dump(doc, sort_keys=False), base_dir=ROOT / "examples")
    assert [sc.p("d_model") for sc in scenarios] == [4, 6]
    for sc in scenarios:
        result = checker.run_scenario(sc)
        assert result.verdict == "pass"
        (w1,) = [c for c in result.checks if c.name == "gradient w1"]
        assert w1.shape == (sc.p("d_model"), 3)


MHA_SOURCE = '''
import torch
import torch.nn.functional as F


class MHA(torch.nn.Module):
    def __init__(self, d_model, heads, bias=False, drop_mask=False):
        super().__init__()
        self.heads, self.drop_mask = heads, drop_mask
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = torch.nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, mask=None):
        d = x.shape[-1]
        q, k, v = self.qkv(x).split(d, -1)
        split = lambda t: t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
        if mask is not None and self.drop_mask:
            mask = ~mask  # this module's mask hides True
        o = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return self.proj(o.transpose(1, 2).flatten(-2))


def mha(d_model, heads_q):
    return MHA(d_model, heads_q)


def mha_bias(d_model, heads_q):
    return MHA(d_model, heads_q, bias=True)


def mha_drop(d_model, heads_q):
    return MHA(d_model, heads_q, drop_mask=True)
'''


def _mha(tmp_path, factory, call=("x", "visible"), **keys):
    pytest.importorskip("torch")
    (tmp_path / "mymods.py").write_text(MHA_SOURCE)
    impl = {"factory": f"mymods:{factory}",
            "weights": {"qkv.weight": "concat(w_q.T, w_k.T, w_v.T)", "proj.weight": "w_o.T"}}
    if call is not None:
        impl["call"] = list(call)
    doc = {"name": "mha", "op": "attention-projections", "backend": "torch", "batch": 2, "heads_q": 2, "n_q": 5,
           "d_head": 4, "d_model": 8, "mask": {"causal": "lower-right", "key_lengths": [5, 3]},
           "implementation": impl, **keys}
    return checker.run_scenario(scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0])


def test_a_frozen_bias_that_changes_the_forward_is_named_in_the_hint(tmp_path):
    result = _mha(tmp_path, "mha_bias")
    assert "forward agrees with the reference" in {c.name for c in result.checks if not c.passed}
    assert any("qkv.bias" in h and "bias=False" in h for h in result.hints), result.hints


def test_a_module_whose_mask_hides_true_is_told_to_set_the_mask_convention_and_passes_with_it(tmp_path):
    result = _mha(tmp_path, "mha_drop")  # a lower-right causal row sees every key: hidden by this module, NaN
    assert result.verdict == "fail"
    assert any("set convention: {mask: drop}" in h for h in result.hints), result.hints
    assert _mha(tmp_path, "mha_drop", convention={"mask": "drop"}).verdict == "pass"
    assert not _mha(tmp_path, "mha").hints


def test_a_module_called_without_the_mask_is_told_so(tmp_path):
    result = _mha(tmp_path, "mha", call=None)
    assert result.verdict == "fail"
    assert any("called without the mask" in h and "'visible'" in h for h in result.hints), result.hints


def test_a_layers_convention_takes_the_mask_keys_only():
    doc = {**MLP, "op": "attention-projections", "n_q": 3, "d_head": 2, "d_model": 4, "convention": {"layout": "bnhd"},
           "implementation": "torch_ops:attention_projections"}
    doc.pop("n"), doc.pop("d_ff")
    _rejected(doc, "convention.layout", "does not apply to op attention-projections", "mask, mask_heads")


def test_a_square_weight_mapped_without_its_transpose_gets_the_mapping_to_write(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "mymods.py").write_text(MHA_SOURCE)
    for weights, expected in (({"qkv.weight": "concat(w_q.T, w_k.T, w_v.T)", "proj.weight": "w_o"},
                               "proj.weight: w_o.T"),
                              ({"qkv.weight": "concat(w_q, w_k.T, w_v.T)", "proj.weight": "w_o.T"},
                               "qkv.weight: concat(w_q.T, w_k.T, w_v.T)")):
        doc = {"name": "mha", "op": "attention-projections", "backend": "torch", "heads_q": 2, "n_q": 4, "d_head": 4,
               "d_model": 8, "implementation": {"factory": "mymods:mha", "weights": weights, "call": ["x", "visible"]}}
        result = checker.run_scenario(scenario.loads(yaml.safe_dump({"scenarios": [doc]}), base_dir=tmp_path)[0])
        assert result.verdict == "fail" and any(expected in h for h in result.hints), result.hints
