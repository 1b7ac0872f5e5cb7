"""bench/numerics_pin.py at its tiniest: in the process where MKL started before posttrain the same
values give several products at four addresses and three thread counts, in the pinned one a
single product; both modes are the ones the bench says they are (the speeds are the bench's to
print, not to assert)."""

from __future__ import annotations

import pytest

from bench import numerics_pin
from posttrain.numerics import STRICT_MKL, mkl_mode

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(mkl_mode() is None, reason="torch here has no MKL"),
]


def test_the_pinned_process_gives_one_product(capsys: pytest.CaptureFixture) -> None:
    best = numerics_pin.main(["--hidden", "64", "--layers", "1", "--tokens", "64", "--rounds", "1"])
    out = capsys.readouterr().out
    assert best["pinned"]["mode"] == STRICT_MKL and best["default"]["mode"] != STRICT_MKL
    assert best["pinned"]["outcomes"] == 1 and best["default"]["outcomes"] > 1
    assert "products of same values" in out and "LoRA step" in out
