"""Imported at startup by the Python processes the tests run under libfaketime (PYTHONPATH).

libfaketime 0.9.10 (Debian 12) with ``DONT_FAKE_MONOTONIC=1`` mangles the absolute deadline of
``clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)``, which ``time.sleep`` uses since Python
3.11: it raises EINVAL (wolfcw/libfaketime#426 on GitHub). Waits with a timeout (locks, events,
conditions, select) are unaffected, so ``time.sleep`` is rebuilt on ``select``, whose timeout
is relative. The wall clock stays faked; the monotonic clock stays real.
"""

from __future__ import annotations

import os
import select
import time

if os.environ.get("FAKETIME") and os.environ.get("DONT_FAKE_MONOTONIC") == "1":

    def _sleep(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            select.select([], [], [], left)

    time.sleep = _sleep
