"""The web page in a real browser (headless Chromium) against the running stack: what a person sees and does."""

from __future__ import annotations

from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as ec

from tests.support.waits import JOB_SECONDS, finished, job_row
from tests.web.conftest import PASSWORD

# 2,960 s of work × 2 (100 steps) at the tests' clock (GENSERVER_TIME_SCALE=0.002) → about 12 s:
# the long class's expected wait is then over its limit, so a second one is refused.
LONG_VIDEO = {"width": 1280, "height": 720, "num_frames": 81, "steps": 100}


def test_sign_in_submit_watch_the_preview_and_get_the_images(stack, page, make_person):
    make_person("alice")
    page.sign_in("alice", PASSWORD)
    assert page.text_of("whoami") == "alice"
    assert not page.driver.find_elements(By.ID, "queues-panel")  # not staff

    # 128² × 50 steps with a preview every step: a second or more of denoising to watch.
    page.fill(
        "tiny-sd",
        "a lighthouse at dusk, oil painting",
        width=128,
        height=128,
        steps=50,
        preview_every=1,
        num_outputs=2,
        seed=7,
    )
    page.submit()
    job_id = page.live_job_id()

    page.until(page.image_loaded("#live-preview"), JOB_SECONDS, "a preview while denoising")
    assert "Latest preview, step" in page.text_of("live-preview-caption")
    page.shot("denoising")

    page.until_status("succeeded")
    outputs = page.until(
        lambda d: len(found := d.find_elements(By.CSS_SELECTOR, "#live-outputs img")) == 2 and found, what="both images"
    )
    for index in range(2):
        page.until(page.image_loaded(f"#live-outputs figure:nth-child({index + 1}) img"), what=f"image {index}")
    assert all(
        img.get_attribute("src").endswith(f"/api/v1/jobs/{job_id}/outputs/{i}/") for i, img in enumerate(outputs)
    )
    assert not page.driver.find_element(By.ID, "live-preview-box").is_displayed()  # the images replaced it
    assert page.text_of("live-progress-label") == "Progress: step 50 of 50"
    assert not page.driver.find_element(By.ID, "cancel-button").is_displayed()

    # The history lists it with a thumbnail, a re-run button and download links.
    page.until(page.image_loaded(f"#history li[data-job-id='{job_id}'] img.thumb"), what="the job in the history")
    item = page.driver.find_element(By.CSS_SELECTOR, f"#history li[data-job-id='{job_id}']")
    assert [a.text for a in item.find_elements(By.CSS_SELECTOR, "a[download]")] == ["Download 1", "Download 2"]
    page.shot("finished")

    job = job_row(job_id)
    assert job.status == "succeeded" and len(job.outputs) == 2 and job.owner.username == "alice"
    assert job.preview_every == 1 and job.seed == 7 and (job.width, job.height) == (128, 128)

    # Re-run with the same settings: a second job, same seed and size.
    item.find_element(By.CSS_SELECTOR, "button.rerun").click()
    rerun_id = page.until(
        lambda d: (h := d.execute_script("return location.hash")) != f"#job={job_id}" and h[5:],
        what="the re-run to open",
    )
    rerun = finished(rerun_id)
    assert (rerun.seed, rerun.width, rerun.steps, rerun.num_outputs) == (7, 128, 50, 2)
    assert rerun.status == "succeeded"

    page.sign_out()
    page.driver.get(page.base_url + "/")
    page.until(ec.presence_of_element_located((By.ID, "login-form")), what="signed out: the sign-in form again")


def test_video_flood_is_refused_with_a_retry_and_the_accepted_video_cancels(stack, page, make_person):
    from genserver.jobs.models import Job

    make_person("vera")
    page.sign_in("vera", PASSWORD)
    page.fill("wan-sim", "a storm over the sea", **LONG_VIDEO)
    assert page.driver.find_element(By.ID, "field-num_frames").is_displayed()  # a video model asks for frames
    page.submit()
    video_id = page.live_job_id()

    page.submit()  # the same video again: the long class is full
    page.until(ec.visibility_of_element_located((By.ID, "form-message")), what="the refusal message")
    message = page.text_of("form-message")
    assert message.startswith("The long queue is full right now, retry in "), message
    assert "overloaded" in message, message  # the API's own reason follows
    page.shot("refused")
    assert Job.objects.filter(owner__username="vera").count() == 1  # the refusal left no row

    page.until_status("denoising")
    page.driver.find_element(By.ID, "cancel-button").click()
    page.until_status("cancelled")
    assert finished(video_id).status == "cancelled"
    assert not page.driver.find_element(By.ID, "cancel-button").is_displayed()


def test_others_jobs_are_not_visible_and_field_errors_sit_by_their_fields(stack, page, make_person, live_server):
    from rest_framework.test import APIClient

    from genserver.jobs.models import Job

    owner = make_person("olga")
    client = APIClient()
    client.force_authenticate(owner)
    olgas = client.post("/api/v1/jobs/", {"model": "tiny-sd", "prompt": "olga's secret"}, format="json")
    assert olgas.status_code == 201, olgas.content
    olgas_id = olgas.json()["id"]
    assert finished(olgas_id).status == "succeeded"

    make_person("bob")
    page.driver.set_window_size(390, 844)  # a phone: one column, nothing wider than the screen
    page.sign_in("bob", PASSWORD)
    assert page.driver.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
    page.until_text("history", "No jobs yet.")
    assert olgas_id not in page.driver.page_source
    page.driver.get(f"{page.base_url}/#job={olgas_id}")
    page.until(lambda d: d.find_elements(By.CSS_SELECTOR, "body[data-ready='1']"), what="the page to be ready")
    page.until_text("live-status", "not found")
    assert "olga's secret" not in page.driver.page_source

    # An invalid size: the API's message next to the width field, nothing submitted.
    page.fill("tiny-sd", "a cat", width=100)
    page.submit()
    page.until_text("err-width", "multiple of 16")
    assert page.driver.find_element(By.ID, "f-width").get_attribute("aria-invalid") == "true"
    assert not Job.objects.filter(owner__username="bob").exists()
    page.shot("phone-field-error")
    page.sign_out()

    # Staff see the queues panel (one row per class) and the admin and Flower links.
    make_person("sam", staff=True)
    page.sign_in("sam", PASSWORD)
    page.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#queues tbody tr")) == 3, what="the queues panel")
    rows = {tr.get_attribute("data-queue") for tr in page.driver.find_elements(By.CSS_SELECTOR, "#queues tbody tr")}
    assert rows == {"short", "medium", "long"}
    assert page.driver.find_element(By.ID, "admin-link").get_attribute("href").endswith("/admin/")
    assert page.driver.find_element(By.ID, "flower-link").is_displayed()
