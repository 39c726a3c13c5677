"""Gradient rules: losses family."""
