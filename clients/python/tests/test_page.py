"""The status page in a real browser (Debian's headless Chromium, driven by Selenium through
chromedriver): it loads, lists a running job, follows its progress, cancels it from the
keyboard-reachable button, shows the server's error messages, and passes a basic accessibility
check. A screenshot is saved under target/ for CI to keep."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from conftest import MODEL, corpus, wait_until

CHROMIUM = os.environ.get("HARVEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("HARVEST_CHROMEDRIVER", "/usr/bin/chromedriver")
SCREENSHOT = Path(__file__).resolve().parents[3] / "target" / "status-page.png"

# WCAG 2 contrast of each element's text against the first opaque background behind it.
CONTRAST = """
const parse = (c) => { const m = c.match(/[\\d.]+/g).map(Number); return m.length > 3 ? m : [...m, 1]; };
const lum = ([r, g, b]) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
  return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
const ground = (el) => { for (; el; el = el.parentElement) { const c = parse(getComputedStyle(el).backgroundColor);
  if (c[3] > 0) return c; } return [255, 255, 255, 1]; };
const out = [];
for (const el of document.querySelectorAll(arguments[0])) {
  if (!el.offsetParent || !el.textContent.trim()) continue;
  const fg = lum(parse(getComputedStyle(el).color)), bg = lum(ground(el));
  const ratio = (Math.max(fg, bg) + 0.05) / (Math.min(fg, bg) + 0.05);
  out.push([el.tagName + (el.id ? '#' + el.id : '') + '.' + el.className, Math.round(ratio * 100) / 100]);
}
return out;
"""


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.fail(
            f"{CHROMIUM} or {CHROMEDRIVER} is missing: install Debian's chromium and chromium-driver "
            "(scripts/test-tools.sh does, as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1366,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    yield driver
    driver.quit()


def click(browser, css: str, message: str) -> None:
    """Clicks the element once it is there; a row re-rendered between finding and clicking is
    found again."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    def clicked() -> bool:
        try:
            found = browser.find_elements(By.CSS_SELECTOR, css)
            if found:
                found[0].click()
                return True
        except StaleElementReferenceException:
            pass
        return False

    wait_until(clicked, timeout=30, message=message)


def connect(browser, server, key):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(server.root + "/")
    field = browser.find_element(By.ID, "key-input")
    field.clear()
    field.send_keys(key + Keys.ENTER)


def test_the_page_lists_a_running_job_follows_its_progress_and_cancels_it(browser, server, client):
    from selenium.webdriver.common.by import By

    job = client.submit(corpus(800, words=60), MODEL, layers=[1], shard_size=2)
    connect(browser, server, server.key)
    row = f'tr[data-job-id="{job.id}"]'

    def progress():
        # One script reads the bar, so a row re-rendered meanwhile cannot leave a stale handle.
        value = browser.execute_script(
            "const bar = document.querySelector(arguments[0]); return bar ? bar.value : null;",
            f'{row}[data-status="running"] progress',
        )
        return float(value) if value is not None else None

    first = wait_until(lambda: (progress() or 0) > 0 and progress(), timeout=120, interval=0.1,
                       message="the page to show the job running with some progress")
    later = wait_until(lambda: (progress() or 0) > first and progress(), timeout=120, interval=0.1,
                       message="the page to show the progress moving on")
    assert later > first
    usage = browser.find_element(By.ID, "usage").text
    assert "Small lane (running jobs)" in usage and "1 of 3 jobs" in usage, usage
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))
    labels = browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map(b => b.getAttribute('aria-label'));",
        f"{row} button.cancel",
    )
    assert labels == [f"Cancel job {job.id}"]
    click(browser, f"{row} button.cancel", "the Cancel button")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, f'{row}[data-status="cancelled"]'),
               timeout=30, message="the row to show the job cancelled")
    assert client.job(job.id).status == "cancelled"


def test_the_files_of_a_done_job_are_linked(browser, server, client):
    from selenium.webdriver.common.by import By

    job = client.submit(["A short prompt."], MODEL, layers=[1]).wait(progress=False)
    connect(browser, server, server.key)
    click(browser, f'tr[data-job-id="{job.id}"] button.files', "the done job's Files button")
    links = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#files a"), timeout=30,
                       message="the file links")
    names = [a.text for a in links]
    assert names == ["manifest.json", "stats.safetensors", "shard_00000.safetensors"]
    assert all(a.get_attribute("href").startswith(server.root + "/files/") for a in links)


def test_a_wrong_key_shows_the_servers_own_message(browser, server):
    from selenium.webdriver.common.by import By

    connect(browser, server, "sk-hv-" + "2" * 48)
    error = wait_until(lambda: browser.find_element(By.ID, "error").text, timeout=30,
                       message="the error message")
    assert "invalid_api_key" in error and "HTTP 401" in error, error
    assert browser.find_element(By.ID, "error").get_attribute("role") == "alert"


def test_the_page_has_labels_keyboard_order_and_readable_contrast(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    connect(browser, server, server.key)
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#job-rows tr"), timeout=30,
               message="the job list")
    assert browser.find_element(By.TAG_NAME, "html").get_attribute("lang") == "en"
    for control in browser.find_elements(By.CSS_SELECTOR, "input, select"):
        labels = browser.find_elements(By.CSS_SELECTOR, f'label[for="{control.get_attribute("id")}"]')
        assert labels and labels[0].text.strip(), f"{control.get_attribute('id')} has a visible label"
    # Read in one script: rows re-render every refresh, which would leave stale handles.
    unnamed = browser.execute_script(
        "return [...document.querySelectorAll('button')].filter(b => b.offsetParent)"
        ".filter(b => !((b.getAttribute('aria-label') || b.textContent).trim())).map(b => b.outerHTML);"
    )
    assert unnamed == [], f"buttons without an accessible name: {unnamed}"
    # From a fresh load, Tab reaches the key field, its buttons, then the job list's controls.
    from selenium.webdriver.common.action_chains import ActionChains

    browser.get(server.root + "/")
    wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#job-rows tr"), timeout=30,
               message="the job list after a reload (the key is kept in the tab)")
    order = []
    for _ in range(5):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        order.append(browser.switch_to.active_element.get_attribute("id"))
    assert order == ["key-input", "key-connect", "key-forget", "status-filter", "refresh"], order
    ratios = browser.execute_script(CONTRAST, "h1, h2, p, label, th, td, button, dt, dd, span, #error")
    assert ratios, "some text was checked"
    low = [r for r in ratios if r[1] < 4.5]
    assert not low, f"contrast under 4.5:1: {low}"
