"""The loader never raises anything but ScenarioError, whatever document it is given."""
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcheck_cli import scenario
from gradcheck_cli.errors import ScenarioError

from helpers import examples

KEYS = (list(scenario.SCENARIO_KEYS) + list(scenario.MASK_KEYS) + list(scenario.CHECK_KEYS)
        + ["junk", "x-a", "sweep", "mask.causal", "check.mode"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.floats(allow_nan=True),
                    st.sampled_from(["none", "lower-right", "upper-left", "full", "sample", "directional",
                                     "float32", "float64", "attention", "a", "1e-3", "", "masks/x.npy"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)),
                      max_leaves=20)
scenario_docs = st.fixed_dictionaries(
    {"name": st.one_of(st.sampled_from(["a", "b"]), scalars), "n_q": st.one_of(st.integers(1, 6), scalars),
     "d_head": st.one_of(st.integers(1, 4), scalars)},
    optional={k: values for k in KEYS if k not in ("name", "n_q", "d_head")})
documents = st.one_of(values, st.fixed_dictionaries(
    {"scenarios": st.lists(scenario_docs, max_size=3)},
    optional={"defaults": st.dictionaries(st.sampled_from(KEYS), values, max_size=5)}))


@pytest.mark.slow  # a fuzzer: ~7 s in the dev profile, 3x in ci
@settings(max_examples=examples(5), suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_loader_raises_only_scenario_errors(doc):
    text = yaml.safe_dump(doc)
    try:
        scenario.loads(text, file="fuzz.yaml", memory_limit=2**30)
    except ScenarioError as exc:
        assert exc.file == "fuzz.yaml" and exc.message


@settings(max_examples=examples(20))
@given(st.text(max_size=200))
def test_loader_survives_arbitrary_text(text):
    try:
        scenario.loads(text, file="fuzz.yaml", memory_limit=2**30)
    except ScenarioError:
        pass
