"""The JSON Schema of scenario files: shipped, current, and agreeing with the shipped configs."""
import json

import pytest
import yaml
from click.testing import CliRunner

from gradcheck_cli.cli import main
from gradcheck_cli.scenario import json_schema

jsonschema = pytest.importorskip("jsonschema")


def test_the_shipped_schema_is_current(root):
    shipped = json.loads((root / "schema/scenario.schema.json").read_text())
    assert shipped == json_schema(), "regenerate: attn-gradcheck schema > schema/scenario.schema.json"
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0 and json.loads(result.stdout) == shipped
    jsonschema.Draft202012Validator.check_schema(shipped)


def test_every_shipped_file_validates_and_carries_the_modeline(root):
    validator = jsonschema.Draft202012Validator(json_schema())
    files = sorted((root / "configs").glob("*.yaml")) + sorted((root / "examples").glob("*.yaml"))
    for path in files:
        text = path.read_text()
        assert text.startswith("# yaml-language-server: $schema=../schema/scenario.schema.json"), path
        assert not list(validator.iter_errors(yaml.safe_load(text))), path


@pytest.mark.parametrize("doc", [
    {"scenarios": [{"name": "a", "n_q": 2, "d_head": 2, "bogus": 1}]},
    {"scenarios": [{"name": "a", "n_q": 0, "d_head": 2}]},
    {"scenarios": [{"name": "a", "n_q": 2, "d_head": 2, "mask": {"causal": "sideways"}}]},
    {"scenarios": []},
    {"scenario": []},
])
def test_the_schema_rejects_what_the_loader_rejects(doc):
    assert list(jsonschema.Draft202012Validator(json_schema()).iter_errors(doc))
