"""The Prefect UI, seen in a real headless Chromium: every run tells its own story.

A clip runs on its own (as `k6vsr upscale` runs it); then an archive runs a copy of that clip (the same run key, so
its tiles are reused), another clip and a broken file (and, when it takes screenshots, a clip of two windows), against
the session's Prefect server. On the page of the standalone clip run, of the copy's (and the two-window clip's) run,
children of the archive, and of the archive run, the test checks the artifacts listed under that run and no other,
the progress text with its counts, and the report: its stage table in pipeline order, adding up to at most the run's
duration, and its before/after images decoded by the browser; for the archive, the manifest table with its first
columns in view at 1400 px and links to the clip runs.

Screenshots go to the test's tmp folder, and also to `$K6VSR_SCREENSHOT_DIR` when that is set (the committed
tests/artifacts/*.png, shown in docs/archive.md and the README, were made that way).

Needs the Debian packages `chromium` and `chromium-driver` and the `selenium` package; no browser is downloaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from uuid import UUID

import procs
import pytest

from flows.stage_clock import REPORT_ORDER
from k6vsr_core.contract.params import UpscaleParams
from k6vsr_core.media.sample import make_sample_clip
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
PARAMS = UpscaleParams(scale=2)
WINDOWED_FRAMES = 122  # one frame more than a window
# The screenshot run's archive also has a clip of two windows, for the README: decoding its 242 frames takes a minute
# or more on a CPU, which CI does without.
WINDOWED = SCREENSHOT_DIR is not None


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[object]:
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium (the browser test driver)")
    from selenium.webdriver.chrome.service import Service

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        found = {"chromium": chromium, "chromedriver": driver_path}
        lacking = " and ".join(name for name, path in found.items() if path is None)
        reason = f"{lacking} not installed: apt-get install -y chromium chromium-driver"
        if os.environ.get("CI"):  # .ci/run installs both: a browser test skipped there would pass unseen
            pytest.fail(reason)
        pytest.skip(reason)
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


# --------------------------------------------------------------------------------------------------- the page


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


def _body(driver) -> str:
    return driver.find_element("tag name", "body").text


def _wait_text(driver, *texts: str) -> None:
    _wait(driver, lambda d: all(t in _body(d) for t in texts), " and ".join(texts))


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


def _artifact_cards(driver) -> dict[str, str]:
    """Key -> text of each artifact card on the page."""
    return driver.execute_script(
        "return Object.fromEntries([...document.querySelectorAll('.artifact-card')].map(card =>"
        " [card.querySelector('.artifact-card__title').textContent.trim(), card.innerText]))"
    )


def _open_card(driver, key: str) -> None:
    title = f"//div[contains(@class, 'artifact-card__title') and normalize-space(.)='{key}']"
    driver.find_element("xpath", title).click()


def _table(driver, first_header: str) -> list[list[str]]:
    """The rendered markdown table whose first header is `first_header`: its header and body rows, as text."""
    return driver.execute_script(
        "const table = [...document.querySelectorAll('table')].find(t => t.querySelector('th')"
        "  && t.querySelector('th').textContent.trim() === arguments[0]);"
        "return table ? [...table.rows].map(r => [...r.cells].map(c => c.textContent.trim())) : [];",
        first_header,
    )


def _images_loaded(driver) -> int:
    return driver.execute_script(
        "return [...document.images].filter(i => i.src.startsWith('data:image/') && i.complete"
        " && i.naturalWidth > 0).length"
    )


def _screenshot(driver, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, Path(SCREENSHOT_DIR) / name)


# --------------------------------------------------------------------------------------------------- the API


def _flow_run(name: str | None = None, run_id: UUID | None = None):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        if run_id is not None:
            return client.read_flow_run(run_id)
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
    assert runs, f"no flow run named {name}"
    return runs[0]


def _keys_of(run_id: UUID) -> set[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
    return {artifact.key for artifact in found}


# --------------------------------------------------------------------------------------------------- the checks


def _check_clip_run(
    driver, ui: str, run, run_key: str, all_keys: set[str], tiles: int, computed: int, tmp_path: Path, shot: str
) -> None:
    """The clip run's page lists its own progress and report; the report tells this run's story."""
    from flows.artifacts import clip_key

    source = run.parameters["prepared"]["source"]  # the clip flow's one parameter: the run its caller planned
    progress_key, report_key = (clip_key(kind, source, run_key) for kind in ("tiles", "clip-report"))
    own = {progress_key, report_key}
    driver.get(f"{ui}/runs/flow-run/{run.id}")
    _wait_text(driver, run.name, "Completed")
    _tab(driver, "Artifacts")
    cards = _wait(driver, lambda d: len(_artifact_cards(d)) == len(own) and _artifact_cards(d), f"{own} listed")
    assert set(cards) == own and not (set(cards) & (all_keys - own))
    assert f"done · {tiles} of {tiles} tiles" in cards[progress_key]
    assert f"{computed} tiles computed, {tiles - computed} reused" in cards[report_key]
    _screenshot(driver, tmp_path, f"{shot}-run.png")

    _open_card(driver, report_key)
    stages = _wait(driver, lambda d: _table(d, "stage"), "the report's stage table")
    assert stages[0] == ["stage", "starts (s)", "ends (s)", "span (s)", "adds (s)", "tasks"]
    names = [row[0] for row in stages[1:-1]]
    assert names == [stage for stage in REPORT_ORDER if stage in names] and names[0] == "ingest"
    assert names[-1] == "publish" and stages[-1][0] == "run"
    duration = (run.end_time - run.start_time).total_seconds()
    adds = [float(row[4]) for row in stages[1:-1]]
    assert 0 < round(sum(adds), 2) == float(stages[-2][2]) <= float(stages[-1][2]) <= duration
    assert all(float(row[3]) <= duration for row in stages[1:])
    assert _table(driver, "tiles")[1] == [str(tiles), str(computed), str(tiles - computed)]
    _wait(driver, lambda d: _images_loaded(d) >= 2, "the before/after preview images")
    _screenshot(driver, tmp_path, f"{shot}-report.png")


def test_every_run_tells_its_own_story(prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, browser) -> None:
    from flows.orchestrate import run_clip
    from flows.upscale_archive import archive_slug, upscale_archive
    from service.runs import prepare_run

    ui = prefect_server.removesuffix("/api")
    with urllib.request.urlopen(ui, timeout=10) as response:
        if b"<html" not in response.read(4096).lower():
            pytest.skip(f"the Prefect server at {ui} serves no UI (PREFECT_UI_ENABLED is off)")
    model = ModelSpec(model=str(tiny_bundle_path), device="cpu")
    store = str(tmp_path / "store")

    # A clip on its own (2 tiles), then an archive with a copy of it, another clip and a broken file.
    clip = make_sample_clip(tmp_path / "harbour.mp4", width=96, height=64, num_frames=1, tone_hz=590.0)
    alone = run_clip(prepare_run(clip, PARAMS, model, store), str(tmp_path / "harbour_sr2x.mp4"), model).summary()
    folder = tmp_path / "nightly"
    (folder / "copies").mkdir(parents=True)
    shutil.copyfile(clip, folder / "copies" / "harbour.mp4")
    make_sample_clip(folder / "dawn.mp4", width=64, height=64, num_frames=1, tone_hz=610.0)
    if WINDOWED:  # two windows of one 64x64 tile: the smallest clip whose run passes from window to window
        make_sample_clip(folder / "tide.mp4", width=64, height=64, num_frames=WINDOWED_FRAMES, audio=False)
    done = 3 if WINDOWED else 2
    (folder / "broken.mp4").write_bytes(b"\x00not a video\xff" * 300)
    state = upscale_archive(
        input_dir=str(folder),
        output_dir=str(tmp_path / "out"),
        params=PARAMS,
        model=model,
        store_root=store,
        max_parallel=2,
        return_state=True,
    )
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary.counts == {"done": done, "skipped": 1}
    rows = {row.relative_path: row for row in summary.rows}
    slug = archive_slug(folder)

    standalone = _flow_run(name="upscale-harbour.mp4")
    copy = _flow_run(name="upscale-copies/harbour.mp4")
    dawn = _flow_run(name="upscale-dawn.mp4")
    clip_runs = [copy, dawn, *([_flow_run(name="upscale-tide.mp4")] if WINDOWED else [])]
    archive = _flow_run(run_id=state.state_details.flow_run_id)
    assert rows["copies/harbour.mp4"].run_key == alone.run_key
    all_keys = set().union(*(_keys_of(run.id) for run in (standalone, *clip_runs, archive)))
    # Two clips sharing one run key keep apart: 2 artifacts per clip run, 2 for the archive.
    assert len(all_keys) == 2 * (1 + len(clip_runs)) + 2

    _check_clip_run(
        browser,
        ui,
        standalone,
        alone.run_key,
        all_keys,
        tiles=alone.tiles_total,
        computed=alone.tiles_total,
        tmp_path=tmp_path,
        shot="browser-clip",
    )
    _check_clip_run(
        browser,
        ui,
        copy,
        alone.run_key,
        all_keys,
        tiles=alone.tiles_total,
        computed=0,
        tmp_path=tmp_path,
        shot="browser-archive-clip",
    )
    assert "published from the finished run in the store" in _body(browser)
    if WINDOWED:
        assert rows["tide.mp4"].tiles == 2  # one tile in each of two windows
        tide = clip_runs[-1]
        _check_clip_run(
            browser, ui, tide, rows["tide.mp4"].run_key, all_keys, 2, 2, tmp_path, shot="browser-windowed-clip"
        )

    # The archive run: its clip runs, its progress over clips and its one manifest table.
    browser.get(f"{ui}/runs/flow-run/{archive.id}")
    _wait_text(browser, archive.name, "Completed", "upscale-archive")
    _tab(browser, "Subflow Runs")
    for clip_run in clip_runs:
        _wait(browser, lambda d, name=clip_run.name: _run_state(d, name) == "Completed", f"{clip_run.name} Completed")
    _tab(browser, "Artifacts")
    own = {f"archive-progress-{slug}", f"archive-manifest-{slug}"}
    cards = _wait(browser, lambda d: len(_artifact_cards(d)) == 2 and _artifact_cards(d), f"{own} listed")
    assert set(cards) == own
    assert f"clips: {done} done, 0 failed, 0 left" in cards[f"archive-progress-{slug}"]
    assert f"{done} done, 1 skipped" in cards[f"archive-manifest-{slug}"]
    _screenshot(browser, tmp_path, "browser-archive.png")

    _open_card(browser, f"archive-manifest-{slug}")
    table = _wait(browser, lambda d: _table(d, "clip"), "the manifest table")
    assert table[0][:6] == ["clip", "status", "tiles", "computed", "reused", "seconds"]
    assert {row[0]: row[1] for row in table[1:]} == {
        "broken.mp4": "skipped",
        "dawn.mp4": "done",
        "copies/harbour.mp4": "done",
        **({"tide.mp4": "done"} if WINDOWED else {}),
    }
    assert next(row for row in table if row[0] == "broken.mp4")[-1].startswith("not a readable media file")
    # The first six columns are in view at 1400 px: no scrolling to see what happened to a clip.
    assert browser.execute_script(
        "const table = [...document.querySelectorAll('table')].find(t => t.querySelector('th').textContent.trim()"
        "  === 'clip'); const box = table.parentElement.getBoundingClientRect();"
        "return table.rows[0].cells[5].getBoundingClientRect().right <= box.right;"
    )
    _screenshot(browser, tmp_path, "browser-manifest.png")
    # Markdown links open in a new tab.
    browser.find_element("link text", "dawn.mp4").click()
    _wait(browser, lambda d: len(d.window_handles) == 2, "a new tab for the clip run")
    browser.switch_to.window(browser.window_handles[-1])
    _wait(browser, lambda d: d.current_url.endswith(f"/runs/flow-run/{dawn.id}"), "the clip run the manifest links")
    _wait_text(browser, "upscale-dawn.mp4", "Completed")


def test_a_killed_run_is_shown_crashed_after_the_next_command(
    prefect_server: str, tiny_bundle_path: Path, tmp_path: Path, browser
) -> None:
    """`k6vsr upscale` SIGKILLed in the middle of a tile: its run stays Running in the API until the next command
    (here `k6vsr server status`) finds its process dead; from then on the UI shows it Crashed."""
    import sys

    import fault_harness

    clip = make_sample_clip(tmp_path / "killed.mp4", width=96, height=64, num_frames=1)
    argv = ["upscale", str(clip), "--scale", "2", "--model", str(tiny_bundle_path), "--device", "cpu",
            "--store", str(tmp_path / "store"), "-o", str(tmp_path / "out"), "--json"]  # fmt: skip
    (killed,) = fault_harness.run_all([fault_harness.command(*argv, specs=("kill@decode",))])
    assert killed.returncode == -9, killed.stderr[-2000:]
    run = _flow_run("upscale-killed.mp4")
    assert run.state.name == "Running"
    status = procs.run([sys.executable, "-m", "entrypoints.cli", "server", "status", "--json"])
    assert status.returncode == 0, status.stderr[-2000:]
    assert _flow_run(run_id=run.id).state.name == "Crashed"
    browser.get(f"{prefect_server.removesuffix('/api')}/runs/flow-run/{run.id}")
    _wait_text(browser, run.name, "Crashed")
    _screenshot(browser, tmp_path, "killed-run.png")
