"""Gradient rules: shape family."""
