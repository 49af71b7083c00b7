"""A real browser for the web pages' tests: Debian's headless Chromium, driven by Selenium
through Debian's chromedriver at its fixed path.

Nothing is downloaded: the driver's path is given, ``SE_OFFLINE`` keeps Selenium Manager from
looking for browsers or drivers on the network, and a machine without the packages skips the
tests with the command that installs them (``make test`` runs it: the Makefile's ``browser``
target). The browser's console is collected (``goog:loggingPrefs``) so a test can assert that a
page logged no error.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = "apt-get install -y chromium chromium-driver"
WINDOW = (1280, 1000)


def require_browser() -> None:
    """Skip the calling test where Debian's chromium and its driver are not installed."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.skip(f"no {', '.join(missing)}: {INSTALL} (make test does)")


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """A headless Chromium session, quit at the end."""
    require_browser()
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never go to the network
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # the tests may run as root, where Chromium's sandbox refuses to start
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--force-device-scale-factor=1",
        "--lang=en-US",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(executable_path=str(CHROMEDRIVER))
    assert shutil.which(str(CHROMEDRIVER)), CHROMEDRIVER
    driver = webdriver.Chrome(service=service, options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[str]:
    """The console's errors since the last call (the log is drained as it is read)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def wait_for(driver: Any, what: str, check: Any, timeout: float = 60.0) -> Any:
    """``check(driver)``'s first truthy value within ``timeout`` s, polled every 50 ms; fails
    with ``what`` and the console's errors otherwise."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.05).until(check)
    except TimeoutException:
        raise AssertionError(
            f"{what} within {timeout} s; console: {console_errors(driver)}"
        ) from None
