"""The Prefect UI as the archive's dashboard, seen in a real headless Chromium.

A small archive (two tiny clips in nested folders and one broken file) runs against the session's Prefect server;
then the UI must show the archive run and its clip runs with their states, the manifest table artifact (the broken
file skipped with its reason) and a clip's before/after preview images. The screenshot of the archive run's
artifacts goes to the test's tmp folder, and also to `$K6VSR_SCREENSHOT_DIR` when that is set (the committed
tests/artifacts/browser-archive.png was made that way).

Needs the Debian packages `chromium` and `chromium-driver` and the `selenium` package; no browser is downloaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from k6vsr_core.params import UpscaleParams
from k6vsr_core.sample import make_sample_clip
from service.runs import ModelSpec

pytestmark = pytest.mark.slow

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1250",
)
WAIT_S = 60
SCREENSHOT_DIR = os.environ.get("K6VSR_SCREENSHOT_DIR")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (the browser test driver)")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("headless Chromium is not installed: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path, prefix='chromium-')}"):
        options.add_argument(flag)
    # An explicit driver path: Selenium Manager never downloads anything.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition: Callable[[object], object], what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(condition)
    except TimeoutException:
        body = driver.find_element("tag name", "body").text
        raise AssertionError(
            f"the UI at {driver.current_url} did not show {what} in {WAIT_S} s; it shows:\n{body[:3000]}"
        ) from None


def _wait_text(driver, *texts: str) -> None:
    _wait(driver, lambda d: all(t in d.find_element("tag name", "body").text for t in texts), " and ".join(texts))


def _tab(driver, name: str) -> None:
    tab = _wait(
        driver,
        lambda d: d.find_elements("xpath", f"//li[contains(@class, 'p-tab') and normalize-space(.)='{name}']"),
        f"the {name} tab",
    )
    tab[0].click()


def _run_state(driver, run_name: str) -> str:
    """The state badge of the listed flow run named `run_name` (empty while it is not listed)."""
    rows = driver.find_elements(
        "xpath", f"//a[normalize-space(.)='{run_name}']/ancestor::div[contains(@class, 'state-list-item ')][1]"
    )
    if not rows:
        return ""
    badges = rows[0].find_elements("css selector", ".state-badge")
    return badges[0].text.strip() if badges else ""


def _latest_artifact_id(key: str) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), sort=ArtifactSort.CREATED_DESC, limit=1
        )
    assert found, f"no artifact with key {key}"
    return str(found[0].id)


def test_archive_in_the_prefect_ui(prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, browser) -> None:
    from flows.upscale_archive import archive_slug, upscale_archive

    ui = prefect_server.removesuffix("/api")
    with urllib.request.urlopen(ui, timeout=10) as response:
        if b"<html" not in response.read(4096).lower():
            pytest.skip(f"the Prefect server at {ui} serves no UI (PREFECT_UI_ENABLED is off)")

    folder = tmp_path / "nightly-clips"
    (folder / "harbour").mkdir(parents=True)
    make_sample_clip(folder / "dawn.mp4", width=64, height=64, num_frames=1, tone_hz=610.0)
    make_sample_clip(folder / "harbour" / "dusk.mp4", width=96, height=64, num_frames=1, tone_hz=620.0)
    (folder / "broken.mp4").write_bytes(b"\x00not a video\xff" * 300)
    state = upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=UpscaleParams(scale=2),
        model=ModelSpec(model=str(tiny_bundle_path), device="cpu"),
        store_root=str(tmp_path / "store"),
        max_parallel=2,
        return_state=True,
    )
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.counts == {"done": 2, "skipped": 1}
    archive_id = str(state.state_details.flow_run_id)
    slug = archive_slug(folder)
    dawn = next(row for row in summary.rows if row.relative_path == "dawn.mp4")

    # The archive run, its state, and its clip runs with theirs.
    browser.get(f"{ui}/runs/flow-run/{archive_id}")
    _wait_text(browser, "archive-nightly-clips", "Completed", "upscale-archive")
    _tab(browser, "Subflow Runs")
    for clip_run in ("upscale-dawn.mp4", "upscale-harbour/dusk.mp4"):
        _wait(browser, lambda d, name=clip_run: _run_state(d, name) == "Completed", f"{clip_run} Completed")

    # The runs page lists them all.
    browser.get(f"{ui}/runs")
    for run_name in ("archive-nightly-clips", "upscale-dawn.mp4", "upscale-harbour/dusk.mp4"):
        _wait(browser, lambda d, name=run_name: _run_state(d, name) == "Completed", f"{run_name} Completed")

    # The archive's artifacts: the progress over clips and the manifest table.
    browser.get(f"{ui}/runs/flow-run/{archive_id}")
    _tab(browser, "Artifacts")
    _wait_text(browser, f"archive-progress-{slug}", f"archive-manifest-{slug}", "2 done, 1 skipped")
    screenshot = tmp_path / "browser-archive.png"
    assert browser.save_screenshot(str(screenshot))
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(screenshot, Path(SCREENSHOT_DIR) / screenshot.name)

    browser.get(f"{ui}/artifacts")
    _wait_text(browser, f"archive-manifest-{slug}", f"clip-report-{dawn.run_key[:12]}")

    browser.get(f"{ui}/artifacts/artifact/{_latest_artifact_id(f'archive-manifest-{slug}')}")
    _wait_text(
        browser,
        "relative_path",
        "dawn.mp4",
        "harbour/dusk.mp4",
        "done",
        "broken.mp4",
        "skipped",
        "not a readable media file",
        "harbour/dusk_sr2x.mp4",
    )
    browser.save_screenshot(str(tmp_path / "browser-manifest.png"))

    # A clip's report: the before/after preview images, decoded by the browser.
    browser.get(f"{ui}/artifacts/artifact/{_latest_artifact_id(f'clip-report-{dawn.run_key[:12]}')}")
    _wait_text(browser, "dawn.mp4", "before (64", "after (128")
    _wait(
        browser,
        lambda d: (
            d.execute_script(
                "return [...document.images].filter(i => i.src.startsWith('data:image/') && i.complete"
                " && i.naturalWidth > 0).length"
            )
            >= 2
        ),
        "the before/after preview images",
    )
    browser.save_screenshot(str(tmp_path / "browser-report.png"))
