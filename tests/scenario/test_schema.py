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


def test_the_shipped_report_schema_is_current_and_every_report_meets_it(root, tmp_path):
    from gradcheck_cli.report.schema import report_schema
    shipped = json.loads((root / "schema/report.schema.json").read_text())
    assert shipped == report_schema(), "regenerate: attn-gradcheck schema --report > schema/report.schema.json"
    result = CliRunner().invoke(main, ["schema", "--report"])
    assert result.exit_code == 0 and json.loads(result.stdout) == shipped
    jsonschema.Draft202012Validator.check_schema(shipped)
    validator = jsonschema.Draft202012Validator(shipped)
    for args in (["configs/quickstart.yaml", "--fault", "softmax-term"], ["configs/gqa.yaml", "--negative-controls"],
                 ["examples/broken.yaml"]):
        out = tmp_path / "r.json"
        CliRunner().invoke(main, ["run", str(root / args[0]), *args[1:], "--json", str(out)])
        assert not list(validator.iter_errors(json.loads(out.read_text())))
