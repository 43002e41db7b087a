"""The page as the tests see it: sign in, fill the form, read the live job, each wait a WebDriverWait condition."""

from __future__ import annotations

from pathlib import Path

from selenium.common.exceptions import TimeoutException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import Select, WebDriverWait

from tests.support.waits import JOB_SECONDS

PAGE_SECONDS = 30.0  # a page load or an API answer on a busy 2-core machine; only a real failure reaches it


class Page:
    def __init__(self, driver: WebDriver, base_url: str, screenshots: Path, prefix: str) -> None:
        self.driver, self.base_url, self.folder, self.prefix = driver, base_url, screenshots, prefix

    # --- waiting -------------------------------------------------------------------------------
    def until(self, condition, timeout: float = PAGE_SECONDS, what: str = ""):
        """Wait for `condition`; on a timeout, a screenshot and the page's live job go into the failure."""
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(condition)
        except TimeoutException:
            shot = self.shot("timeout")
            state = self.driver.execute_script("return typeof liveJob === 'undefined' ? null : liveJob")
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what}; screenshot {shot}; the page's live job: {state}"
            ) from None

    def text_of(self, element_id: str) -> str:
        return self.driver.find_element(By.ID, element_id).text

    def until_text(self, element_id: str, wanted: str, timeout: float = PAGE_SECONDS) -> None:
        self.until(
            ec.text_to_be_present_in_element((By.ID, element_id), wanted), timeout, f"#{element_id} to show {wanted!r}"
        )

    def image_loaded(self, css: str):
        """A condition: an <img> matching `css` is displayed and its picture decoded."""

        def loaded(driver):
            for img in driver.find_elements(By.CSS_SELECTOR, css):
                if img.is_displayed() and driver.execute_script(
                    "return arguments[0].complete && arguments[0].naturalWidth > 0", img
                ):
                    return img
            return False

        return loaded

    def shot(self, name: str) -> Path:
        path = self.folder / f"{self.prefix}-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    # --- signing in and out -----------------------------------------------------------------------
    def sign_in(self, username: str, password: str) -> None:
        self.driver.get(self.base_url + "/")
        self.until(ec.presence_of_element_located((By.ID, "login-form")), what="the sign-in form")
        self.driver.find_element(By.ID, "id_username").send_keys(username)
        self.driver.find_element(By.ID, "id_password").send_keys(password)
        self.driver.find_element(By.ID, "login-submit").click()
        self.until(lambda d: d.find_elements(By.CSS_SELECTOR, "body[data-ready='1']"), what="the page to be ready")

    def sign_out(self) -> None:
        self.driver.find_element(By.ID, "signout").click()
        self.until(ec.presence_of_element_located((By.ID, "login-form")), what="the sign-in form after signing out")

    # --- the form -----------------------------------------------------------------------------------
    def fill(self, model: str, prompt: str, **fields) -> None:
        Select(self.driver.find_element(By.ID, "f-model")).select_by_value(model)
        self.set_field("prompt", prompt)
        for name, value in fields.items():
            self.set_field(name, value)

    def set_field(self, name: str, value) -> None:
        element = self.driver.find_element(By.ID, f"f-{name}")
        element.clear()
        element.send_keys(str(value))

    def submit(self) -> None:
        self.driver.find_element(By.ID, "submit-button").click()

    # --- the live job ---------------------------------------------------------------------------------
    def live_job_id(self) -> str:
        """The id of the job the live panel shows (from the page's address, #job=<id>)."""
        return self.until(
            lambda d: (h := d.execute_script("return location.hash")).startswith("#job=") and h[5:],
            what="the page to open the submitted job",
        )

    def until_status(self, wanted: str, timeout: float = JOB_SECONDS) -> None:
        self.until(
            lambda d: d.find_element(By.ID, "live-status").get_attribute("data-status") == wanted,
            timeout,
            f"the live job to be {wanted}",
        )
