"""Fixtures of the browser tests: headless Debian Chromium driven by selenium, screenshots in a temporary folder.

The browser is the system's (`apt-get install chromium chromium-driver`; `.ci/run`
installs them when missing); nothing is downloaded. The page is served by
pytest-django's `live_server` (the API and the page in the test process) and
the jobs run on the `stack` fixture's real workers.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.web.page import Page

PASSWORD = "correct horse battery staple"


def _chromium() -> tuple[str, str]:
    driver = shutil.which("chromedriver")
    browser = next(
        (found for name in ("chromium", "chromium-browser", "google-chrome") if (found := shutil.which(name))), None
    )
    if not driver or not browser:
        pytest.fail(
            "the browser tests need Chromium and its driver: `apt-get install -y chromium chromium-driver` "
            "(Debian/Ubuntu; .ci/run does this when they are missing)"
        )
    return browser, driver


@pytest.fixture(autouse=True)
def _fast_passwords(settings) -> None:
    """People here sign in with passwords; a cheap hasher keeps that from costing seconds on a busy machine."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(scope="session")
def screenshots() -> Path:
    """Where the tests save what the browser showed (printed at the end of the session).

    A folder of its own, not pytest's tmp_path: pytest keeps only its last three
    base folders, and the screenshots should outlive the next runs.
    """
    folder = Path(tempfile.mkdtemp(prefix="genserver-web-screenshots-"))
    yield folder
    print(f"\nbrowser screenshots: {folder}")


@pytest.fixture
def browser() -> Iterator:
    """A fresh headless Chromium (no cookies, no cache) for one test."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,1100",
        "--force-device-scale-factor=1",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def make_person(django_user_model) -> Callable:
    """A user who signs in with a password, as people do (the admin's users)."""

    def make(username: str, staff: bool = False):
        return django_user_model.objects.create_user(username=username, password=PASSWORD, is_staff=staff)

    return make


@pytest.fixture
def page(browser, live_server, screenshots, request) -> Page:
    return Page(browser, live_server.url, screenshots, prefix=request.node.name)
