"""Gradient rules: linalg family."""
