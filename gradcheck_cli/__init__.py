"""attn-gradcheck: prove hand-derived attention gradients right (finite differences, invariants, faults)."""
__version__ = "0.1.0"
