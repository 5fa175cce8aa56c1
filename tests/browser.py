"""Headless Chromium for tests (Debian's ``chromium`` and ``chromium-driver``, which ``make
test`` installs), driven by selenium with the driver's path given and ``SE_OFFLINE`` set, so
nothing is downloaded. ``needs_browser`` skips a test where they are missing; the ``browser``
fixture (``tests/conftest.py``) is the driver."""

from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or (
    "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)

needs_browser = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="chromium/chromium-driver are not installed (make test installs Debian's packages)",
)
