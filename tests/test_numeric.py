"""Central differences and the error measures on functions whose derivatives are known exactly."""
import numpy as np
import pytest

from gradcheck_cli import numeric
from gradcheck_cli.tolerance import passes, relative_error


def cubic_loss(c):
    def loss(x):
        return np.sum(c * x**3, axis=(-2, -1))
    return loss


def test_elements_recover_a_known_gradient():
    rng = np.random.default_rng(0)
    x, c = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    got = numeric.elements(cubic_loss(c), x, np.arange(x.size), 1e-6, numeric.Chunking(3, 2))
    np.testing.assert_allclose(got, (3 * c * x**2).ravel(), rtol=1e-8, atol=1e-9)


def test_elements_at_selected_indices_and_any_chunk():
    rng = np.random.default_rng(1)
    x, c = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    idx = np.array([11, 0, 5])
    for chunking in (numeric.Chunking(1), numeric.Chunking(1, 2), numeric.Chunking(2, 2), numeric.Chunking(100)):
        got = numeric.elements(cubic_loss(c), x, idx, 1e-6, chunking)
        np.testing.assert_allclose(got, (3 * c * x**2).ravel()[idx], rtol=1e-8, atol=1e-9)


def test_directions_recover_the_directional_derivative():
    rng = np.random.default_rng(2)
    x, c = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    u = numeric.unit_direction(7, 0, x.shape)
    assert np.sqrt((u**2).sum()) == pytest.approx(1.0)
    grad = 3 * c * x**2
    num, ana = numeric.directions(cubic_loss(c), x, grad, np.arange(5), 7, 1e-6, numeric.Chunking(2, 2))
    np.testing.assert_allclose(num, ana, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(ana[0], np.sum(u * grad), rtol=1e-6)
    # the same directions whatever the chunking
    num1, _ = numeric.directions(cubic_loss(c), x, grad, np.arange(5), 7, 1e-6, numeric.Chunking(1))
    picked, _ = numeric.directions(cubic_loss(c), x, grad, np.array([3, 1]), 7, 1e-6, numeric.Chunking(1))
    np.testing.assert_allclose(picked, num[[3, 1]], rtol=1e-12)
    np.testing.assert_allclose(num, num1, rtol=1e-12)


def test_step_scales_with_x_and_is_taken_exactly():
    x = np.array([0.0, 1e-3, 1.0, 1e6])
    plus, minus = numeric.perturb(x, 1e-6)
    h = (plus - minus) / 2
    np.testing.assert_allclose(h, 1e-6 * np.maximum(1.0, np.abs(x)), rtol=1e-9)


def test_relative_error_definition():
    assert relative_error(np.zeros(3), np.zeros(3)) == (0.0, 0.0, 0)
    max_abs, rel, worst = relative_error(np.array([1.0, 2.0, 4.0]), np.array([1.0, 2.5, 4.0]))
    assert (max_abs, worst) == (0.5, 1)
    assert rel == pytest.approx(0.5 / 4.0)


def test_noise_floor_absorbs_rounding_but_not_errors():
    a, n = np.array([1.0, 2.0]), np.array([1.0, 2.0 + 1e-7])
    assert passes(a, n, tolerance=1e-9, noise_floor=0.0) == (False, 0.0)
    assert passes(a, n, tolerance=1e-9, noise_floor=2e-7) == (True, 2e-7)
    # the floor is per element: a large floor elsewhere does not cover this element
    assert not passes(a, n, tolerance=1e-9, noise_floor=np.array([1.0, 0.0]))[0]


def test_non_finite_values_never_pass():
    a, n = np.array([1.0, np.nan]), np.array([1.0, 2.0])
    assert not passes(a, n, tolerance=1.0, noise_floor=10.0)[0]
    max_abs, rel, worst = relative_error(a, n)
    assert worst == 1 and max_abs == rel == float("inf")


def test_colours_take_one_element_per_block_and_cover_everything():
    part_of = np.array([[0, 0, 1], [2, 1, 1], [2, 2, 0]])
    classes = numeric.colours(part_of)
    flat = part_of.ravel()
    assert sorted(np.concatenate(classes).tolist()) == list(range(part_of.size))
    for members in classes:
        assert len(set(flat[members].tolist())) == len(members)
    assert len(classes) == 3  # the largest block has three elements


def blockwise_cubic(c, part_of, blocks, coupling=0.0):
    """L split by blocks: part p = sum over its elements of c x^3 (+ coupling * x[0] in every part)."""
    onehot = (part_of.ravel()[:, None] == np.arange(blocks)[None, :]).astype(float)

    def parts(x):
        flat = x.reshape(x.shape[:-2] + (-1,))
        return (c.ravel() * flat**3) @ onehot + coupling * flat[..., :1]
    return parts


def test_coloured_differences_match_the_known_gradient():
    rng = np.random.default_rng(3)
    x, c = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    part_of = np.repeat(np.arange(4)[:, None], 5, axis=1)  # each row is a block
    got = numeric.coloured(blockwise_cubic(c, part_of, 4), x, part_of, 1e-6, numeric.Chunking(2, 2))
    np.testing.assert_allclose(got, (3 * c * x**2).ravel(), rtol=1e-8, atol=1e-9)
    # independent blocks: what an unmoved block's part changes by is rounding only (a batched matmul may sum in
    # another order than the same product alone, by a few ulps of the parts)
    change, scale, _ = numeric.leakage(blockwise_cubic(c, part_of, 4), x, part_of, rng)
    assert change <= 64 * np.finfo(float).eps * scale


def test_leakage_sees_a_dependence_between_blocks():
    rng = np.random.default_rng(4)
    x, c = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    part_of = np.repeat(np.arange(4)[:, None], 5, axis=1)
    leak, scale, worst = numeric.leakage(blockwise_cubic(c, part_of, 4, coupling=0.5), x, part_of, rng)
    assert leak > 0.1 and worst != 0  # moving block 0 (which holds x[0, 0]) changes blocks that stood still


@pytest.mark.parametrize("source,sink", [(0, 6), (6, 0), (3, 4), (5, 2)])
def test_leakage_finds_a_leak_between_any_two_blocks(source, sink):
    """Group testing: every ordered pair (moved, still) occurs in some copy."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 3))
    part_of = np.repeat(np.arange(7)[:, None], 3, axis=1)

    def parts(y):
        p = y.sum(axis=-1).copy()            # [..., 7]: each row is its own block
        p[..., sink] += 0.3 * y[..., source, 0]
        return p
    leak, _, worst = numeric.leakage(parts, x, part_of, rng)
    assert leak > 0.01 and part_of.ravel()[worst] == sink
