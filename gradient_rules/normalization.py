"""Gradient rules: normalization family."""
