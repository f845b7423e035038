"""The import graph: acyclic, layered as ``pyproject.toml``'s import-linter contracts say, and attention's
formulas a leaf. A change that makes a module reach back up the data flow fails here."""
from __future__ import annotations

from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("gradcheck_cli", cache_dir=None)


def test_no_module_imports_itself_back(graph):
    """No import circle, direct or through others, deferred imports included."""
    cycles = sorted(f"{m} -> {i} -> ... -> {m}" for m in graph.modules
                    for i in graph.find_modules_directly_imported_by(m)
                    if i != m and not m.startswith(i + ".") and graph.chain_exists(importer=i, imported=m))
    assert not cycles, "\n".join(cycles)


def test_the_import_linter_contracts_hold():
    from importlinter.cli import lint_imports
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True) == 0


def test_attention_formulas_are_a_leaf(graph):
    """forward, backward, repeat_kv, sum_groups and the faults import nothing of ours but the registry, the score
    stages and numeric (a leaf: a statistic rounded to a lower precision, for a known mistake), and the stages import
    nothing of ours but the registry and four leaf modules that import nothing of ours (numeric; files and text, for
    a bias read from a .npy file; masks, for a packed batch's positions), each stage module its package's base."""
    stages = "gradcheck_cli.ops.attention.stages"
    ours = {m for m in graph.find_modules_directly_imported_by("gradcheck_cli.ops.attention.formulas")}
    assert ours <= {"gradcheck_cli.ops.registry", stages, "gradcheck_cli.numeric"}, ours
    below = {m for s in graph.find_descendants(stages) | {stages} for m in graph.find_modules_directly_imported_by(s)}
    leaves = {"gradcheck_cli.numeric", "gradcheck_cli.files", "gradcheck_cli.text", "gradcheck_cli.masks"}
    assert below <= {"gradcheck_cli.ops.registry", *leaves, *graph.find_descendants(stages)}, below
    for leaf in ("gradcheck_cli.files", "gradcheck_cli.text", "gradcheck_cli.masks"):
        assert not {m for m in graph.find_modules_directly_imported_by(leaf) if m.startswith("gradcheck_cli")}
    assert not graph.find_modules_directly_imported_by("gradcheck_cli.ops.attention.inputs")


def test_torch_is_imported_only_where_a_scenario_asks_for_it():
    """torch is imported by the torch engine (resolved by name when a scenario uses it), the torch flavour of
    user code (imported when a scenario names a torch implementation), attention's overflow hint for a torch
    scenario, and the loader checking that torch is installed; by nothing else."""
    ext = grimp.build_graph("gradcheck_cli", include_external_packages=True, cache_dir=None)
    allowed = ("gradcheck_cli.ops.attention.torch_engine", "gradcheck_cli.ops.attention.overflow",
               "gradcheck_cli.flavours.torch", "gradcheck_cli.scenario",
               # the per-rank code of a distributed check: run in the rank processes only
               "gradcheck_cli.ops.attention.distributed.rank", "gradcheck_cli.ops.attention.distributed.ring",
               "gradcheck_cli.ops.attention.distributed.scores")
    importers = {m for m in ext.find_modules_that_directly_import("torch") if not m.startswith(allowed)}
    assert not importers
