"""The ``convention:`` keys and ``kv_map: interleaved``: an implementation written natively in another
calling convention (tests/convention_attention.py) passes when the scenario says so, and fails under the
default convention with the hint naming the key and value to set."""
import numpy as np
import pytest

from gradcheck_cli import checker

from helpers import make

GQA = dict(batch=2, heads_q=4, heads_kv=2, n_q=5, n_k=7, d_head=4, mask={"causal": "lower-right",
                                                                       "key_lengths": [7, 6]})
SQUARE = dict(batch=2, heads_q=2, n_q=6, d_head=4, mask={"causal": "lower-right"})

#: (implementation in tests/convention_attention.py, the keys it needs, the setting its hint names)
NATIVE = [
    ("bnhd", {"convention": {"layout": "bnhd"}}, "convention: {layout: bnhd}"),
    ("drop", {"convention": {"mask": "drop"}}, "convention: {mask: drop}"),
    ("additive", {"convention": {"mask": "additive"}}, "convention: {mask: additive}"),
    ("additive_min", {"convention": {"mask": "additive-min"}}, "convention: {mask: additive-min}"),
    ("shared", {"convention": {"mask_heads": "shared"}}, "convention: {mask_heads: shared}"),
    ("no_scale", {"convention": {"scale": "omitted"}}, "convention: {scale: omitted}"),
    ("interleaved", {"kv_map": "interleaved"}, "kv_map: interleaved"),
]


def _result(name, shape=GQA, **keys):
    return checker.run_scenario(make(**shape, **keys, implementation=f"convention_attention:{name}"))


def _failed(result):
    return [(c.name, c.detail) for c in result.checks if not c.passed]


@pytest.mark.parametrize("name,keys,setting", NATIVE, ids=[n for n, *_ in NATIVE])
def test_a_native_implementation_passes_in_its_convention(name, keys, setting):
    result = _result(name, **keys)
    assert result.verdict == "pass" and result.hints == (), _failed(result)
    gradients = {c.tensor: c for c in result.checks if c.kind == "gradient"}
    assert set(gradients) == {"q", "k", "v"} and all(c.max_abs_error < 1e-6 for c in gradients.values())


@pytest.mark.parametrize("name,keys,setting", NATIVE, ids=[n for n, *_ in NATIVE])
def test_under_the_default_convention_it_fails_and_the_hint_names_the_key(name, keys, setting):
    result = _result(name)
    text = " | ".join(result.hints)
    assert result.verdict == "fail", text
    assert f"set {setting}" in text, text
    assert len(result.hints) == 1, text


def test_a_layout_that_fits_the_other_shapes_is_named_from_the_forward_it_computes():
    """heads_q = n_q = n_k: a [B, n, H, d] kernel given [B, H, n, d] returns an O of the right shape (and
    wrong values), so the forward check fails rather than the call."""
    cube = dict(batch=2, heads_q=6, n_q=6, d_head=4)
    result = _result("bnhd", cube)
    assert result.verdict == "fail" and "forward agrees with the reference" in {n for n, _ in _failed(result)}
    assert len(result.hints) == 1 and "set convention: {layout: bnhd}" in result.hints[0], result.hints
    assert _result("bnhd", cube, convention={"layout": "bnhd"}).verdict == "pass"


def test_every_key_at_once():
    result = _result("everything", convention={"layout": "bnhd", "mask": "additive-min", "mask_heads": "shared",
                                               "scale": "omitted"}, kv_map="interleaved")
    assert result.verdict == "pass", _failed(result)


def test_the_tool_converts_around_the_call():
    """What the implementation is given, recorded: q in its layout, its mask, no scale; the report's arrays
    stay in the tool's layout."""
    import convention_attention as mod
    seen = {}

    class Spy(mod.Native):
        def forward(self, *args):
            seen.setdefault("args", args)
            return super().forward(*args)

    mod.spy = Spy(layout="bnhd", mask="additive", heads="shared", scale="omitted")
    try:
        sc = make(**GQA, implementation="convention_attention:spy",
                  convention={"layout": "bnhd", "mask": "additive", "mask_heads": "shared", "scale": "omitted"})
        result = checker.run_scenario(sc)
    finally:
        del mod.spy
    assert result.verdict == "pass", _failed(result)
    q, k, v, mask, kv_map = seen["args"]
    assert q.shape == (2, 5, 4, 4) and k.shape == (2, 7, 2, 4) and v.shape == (2, 7, 2, 4)
    assert mask.shape == (2, 1, 5, 7) and mask.dtype == np.float64
    assert set(np.unique(mask)) == {0.0, -np.inf}
    assert np.array_equal(mask == 0, sc.visible[:, :1])
    assert result.arrays["q"].shape == (2, 4, 5, 4) and result.arrays["analytic_k"].shape == (2, 2, 7, 4)


def test_an_additive_min_mask_holds_the_dtypes_lowest_value():
    import convention_attention as mod
    seen = []

    class Spy(mod.Native):
        def forward(self, *args):
            seen.append(args[3])
            return super().forward(*args)

    mod.spy32 = Spy(mask="additive-min")
    try:
        result = checker.run_scenario(make(**GQA, dtype="float32", implementation="convention_attention:spy32",
                                           convention={"mask": "additive-min"}))
    finally:
        del mod.spy32
    assert result.verdict == "pass", _failed(result)
    assert seen[0].dtype == np.float32 and seen[0].min() == np.finfo(np.float32).min


TORCH = [({"layout": "bnhd"}, {}), ({"mask": "drop"}, {}), ({"mask": "additive"}, {}),
         ({"mask": "additive-min"}, {}), ({"mask_heads": "shared"}, {}), ({"scale": "omitted"}, {}),
         ({}, {"kv_map": "interleaved"})]


@pytest.mark.parametrize("convention,keys", TORCH, ids=lambda x: str(x))
def test_torch_native_implementations(convention, keys):
    """SDPA behind each convention: passes in it; under the default fails with the hint naming it."""
    pytest.importorskip("torch")
    import convention_attention as mod
    kv = keys.get("kv_map", "contiguous")
    name = "torch_" + "_".join(f"{k}_{v}" for k, v in {**convention, "kv": kv}.items()).replace("-", "_")
    setattr(mod, name, mod.torch_native(**{"heads" if k == "mask_heads" else k: v for k, v in convention.items()},
                                        kv=kv))
    try:
        run = lambda **extra: checker.run_scenario(make(**GQA, backend="torch",  # noqa: E731
                                                        implementation=f"convention_attention:{name}", **extra))
        good = run(**keys, **({"convention": convention} if convention else {}))
        bad = run()
    finally:
        delattr(mod, name)
    assert good.verdict == "pass", _failed(good)
    if convention == {"mask": "additive"}:  # SDPA takes a boolean keep mask as well: no convention to get wrong
        assert bad.verdict == "pass", _failed(bad)
        return
    key, value = next(iter(convention.items())) if convention else ("kv_map", "interleaved")
    setting = f"kv_map: {value}" if key == "kv_map" else f"convention: {{{key}: {value}"
    assert bad.verdict == "fail" and any(setting in h for h in bad.hints), bad.hints


def test_jax_dot_product_attention_takes_bnhd():
    """jax.nn.dot_product_attention, as it is: [B, T, N, H] (bnhd), a keep mask, GQA by contiguous groups."""
    pytest.importorskip("jax")
    good = checker.run_scenario(make(**GQA, backend="jax", dtype="float32",
                                     implementation="convention_attention:jax_sdpa", convention={"layout": "bnhd"}))
    assert good.verdict == "pass", _failed(good)
    bad = checker.run_scenario(make(**GQA, backend="jax", dtype="float32",
                                    implementation="convention_attention:jax_sdpa"))
    assert bad.verdict == "fail" and any("set convention: {layout: bnhd}" in h for h in bad.hints), bad.hints
