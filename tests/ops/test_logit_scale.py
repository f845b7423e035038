"""The logit-scale experiment (ops/logit_scale.py): its predictions fail only where the seed says."""
from gradcheck_cli import checker

from helpers import make


def test_logit_scale_prediction_fails_only_where_the_seed_says():
    independent = checker.run_scenario(make(op="logit-scale", d_heads=[8, 32], draws=4000)).checks
    assert all(c.passed for c in independent) and len(independent) == 4
    correlated = checker.run_scenario(make(op="logit-scale", d_heads=[32], draws=4000, correlation=0.4)).checks
    names = {c.name: c for c in correlated}
    assert names["Var(q.k) != d sq^2 sk^2 (correlated)"].passed
    assert names["Var(q.k) = d sq^2 sk^2 (1 + (d-1) rho^2)"].passed
    broken = checker.run_scenario(make(op="logit-scale", d_heads=[32], draws=4000), ("logit-scale-divisor",))
    assert {c.name for c in broken.checks if not c.passed} == {"Var(q.k / sqrt(d)) = sq^2 sk^2"}
