"""benchmarks.public_path --spin: ours' session options spin (and stop at a run's end) only when asked."""
from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks.public_path import SPIN, _user_options, parse_args  # noqa: E402


def _entry(options, key):
    try:
        return options.get_session_config_entry(key)
    except RuntimeError:  # not set
        return None


def test_spin_sets_both_keys_and_the_default_sets_none():
    spun, plain = _user_options(2, spin=True), _user_options(2)
    assert spun.intra_op_num_threads == plain.intra_op_num_threads == 2
    for key, value in SPIN.items():
        assert _entry(spun, key) == value
        assert _entry(plain, key) is None  # the step's own default (spinning off) then applies


def test_spin_flag_parses_off_by_default():
    assert parse_args(["--models", "tiny"]).spin is False
    assert parse_args(["--models", "tiny", "--spin"]).spin is True
