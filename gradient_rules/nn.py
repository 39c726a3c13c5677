"""Gradient rules: nn family."""
