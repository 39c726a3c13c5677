"""Hypothesis in CI (``CI`` set, as .ci/run's runner does) draws the same examples every run, so a red
CI means a change broke something, not that the dice found an old case; local runs keep exploring."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
