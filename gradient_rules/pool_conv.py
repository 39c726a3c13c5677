"""Gradient rules: pool_conv family."""
