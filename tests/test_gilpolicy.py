"""The control-plane process's GIL switch interval (apiary.gilpolicy)."""

from __future__ import annotations

import sys

from apiary import gilpolicy


def test_install_sets_the_switch_interval() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        gilpolicy.install()
        assert abs(sys.getswitchinterval() - gilpolicy.SWITCH_INTERVAL_S) < 1e-9
        assert gilpolicy.SWITCH_INTERVAL_S < 0.005  # shorter than CPython's default
    finally:
        sys.setswitchinterval(before)
