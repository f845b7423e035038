"""Render results: rich tables for people, JSON and JUnit for machines, npz arrays for recomputation.
Files are written atomically (temp file in the same folder, then rename): never half-written.

Modules, each importing only those listed before it: ``schema`` (the JSON Schema of a report),
``common`` (counts, the plain text of a failure), ``terminal`` (rich tables), ``formats``
(the JSON report and its JUnit XML), ``merge`` (``attn-gradcheck merge``), ``registry`` (each report
kind's renderer, by name), ``outputs`` (output paths checked before a run; all reports written
atomically), ``plot`` (``sweep-eps --plot``). The names other modules use are re-exported here."""
from __future__ import annotations

from .common import diagnosis_lines, failure_message, reproduce_command, summary
from .formats import JSON_SCHEMA_VERSION, json_bytes, json_report, junit_xml
from .html import sweeps_html
from .merge import merge_reports, read_report
from .outputs import INPUT_SUFFIXES, STAGE_PREFIX, StagedWrites, prepare_outputs, remove_stale_stages, write_reports
from .plot import plot_sweeps
from .registry import REPORTER_BY_NAME
from .terminal import render_controls, render_merged, render_scenario, render_summary, render_sweep

__all__ = [
    "INPUT_SUFFIXES", "JSON_SCHEMA_VERSION", "REPORTER_BY_NAME", "STAGE_PREFIX", "StagedWrites", "diagnosis_lines",
    "failure_message", "json_bytes", "json_report", "junit_xml", "merge_reports", "plot_sweeps", "prepare_outputs",
    "read_report", "remove_stale_stages", "render_controls", "render_merged", "render_scenario", "render_summary",
    "render_sweep", "reproduce_command", "summary", "sweeps_html", "write_reports",
]
