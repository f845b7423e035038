"""Backends other than the NumPy engine. Each imports its framework only inside its own module."""
