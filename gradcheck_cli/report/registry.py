"""The reporter registry: each kind of report file, by the name the CLI knows it by (``--json``,
``--junit``, ``--html``), mapped to the function that renders its bytes from a JSON report (``json_report`` or
``merge_reports``). Writers are looked up here by name (model: check-jsonschema's REPORTER_BY_NAME)."""
from __future__ import annotations

from collections.abc import Callable

from .formats import json_bytes, junit_xml
from .html import html_report

#: Report kind -> the function that renders that file's bytes from a JSON report.
REPORTER_BY_NAME: dict[str, Callable[[dict], bytes]] = {"json": json_bytes, "junit": junit_xml, "html": html_report}
