"""The report's JSON Schema (report/schema.py): shipped, current, and met by every report."""
import json

import pytest
from click.testing import CliRunner

from gradcheck_cli.cli import main

jsonschema = pytest.importorskip("jsonschema")


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
