"""The MLflow UI in a real browser, for tests: a real ``mlflow server`` on a sqlite store
and headless Debian Chromium driven by Selenium through Debian's chromedriver.

Nothing is downloaded: the browser and its driver are the Debian packages ``chromium`` and
``chromium-driver`` (``.ci/run`` installs them), given to Selenium by path, and Selenium
Manager is told to stay offline (``SE_OFFLINE``). Without them the tests that need a
browser skip, saying which is missing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from conftest import free_port

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 60.0  # per explicit wait: the SPA renders within seconds; a slow VM is not a failure


def browser_missing() -> str | None:
    """Why no browser test can run here (None: it can)."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} missing: install the Debian package {package} (.ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def mlflow_server(store: str, cwd: Path, timeout: float = 180.0) -> Iterator[str]:
    """``mlflow server`` on ``store`` at a free 127.0.0.1 port, as the project's other
    tests start it; yields its URL once /health answers; stops its process group."""
    port = free_port()
    log_path = cwd / "mlflow-server.log"
    log = open(log_path, "w")  # noqa: SIM115 (lives with the server)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
           "MLFLOW_DISABLE_TELEMETRY": "true"}  # fmt: skip
    proc = subprocess.Popen(
        ["mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", store, "--allowed-hosts", f"127.0.0.1:{port}"],
        cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, "mlflow server exited:\n" + log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"mlflow server not healthy after {timeout:.0f} s:\n"
                        + log_path.read_text()[-3000:]
                    ) from None
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def chromium(work: Path, width: int = 2600, height: int = 1400):
    """A headless Chromium session (Selenium WebDriver); quits it at the end. Wide, so the
    logged models table renders its metric columns (the grid renders only the columns in
    view)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    saved = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager: never a download
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", f"--user-data-dir={work / 'profile'}",
                "--no-first-run", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--disable-extensions"):  # fmt: skip
        options.add_argument(arg)
    service = Service(CHROMEDRIVER, log_output=str(work / "chromedriver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()
        if saved is None:
            os.environ.pop("SE_OFFLINE", None)
        else:
            os.environ["SE_OFFLINE"] = saved


@contextlib.contextmanager
def page(driver, base: str, route: str, screenshot: Path):
    """The UI's hash route ``route`` in the classic-ML view (MLflow 3 opens an experiment
    in its GenAI view unless told: there the logged models page is "Agent versions");
    at the end, pass or fail, a screenshot of what it showed and its HTML beside it."""
    driver.get(f"{base}/#{route}?workflowType=machine_learning")
    try:
        yield
    finally:
        driver.save_screenshot(str(screenshot))
        screenshot.with_suffix(".html").write_text(driver.page_source)


def close_assistant(driver, base: str) -> None:
    """MLflow 3.17 opens its "MLflow Assistant" panel on a first visit from 127.0.0.1,
    taking a third of the width: mark it seen and closed before the first page."""
    driver.get(f"{base}/health")
    driver.execute_script(
        "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1', 'true');"
        "localStorage.setItem('mlflow.assistant.panelOpen_v1', 'false');"
    )


def wait_for(driver, what: str, condition, timeout: float = WAIT_S):
    """``condition(driver)`` truthy within ``timeout`` s (polled), else a failure that says
    ``what`` was awaited."""
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.25,
                             ignored_exceptions=[StaleElementReferenceException]).until(condition)  # fmt: skip
    except TimeoutException:
        raise AssertionError(f"the MLflow UI did not show {what} within {timeout:.0f} s "
                             f"({driver.current_url})") from None  # fmt: skip


def chart_points(driver, metric: str, expected: int) -> int:
    """The points drawn on the run page's chart titled ``metric`` once there are
    ``expected`` (a chart draws only once scrolled into view)."""
    from selenium.webdriver.common.by import By

    title = f"//h4[@title='{metric}']"
    (head,) = wait_for(driver, f"the chart {metric}", lambda d: d.find_elements(By.XPATH, title))
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", head)
    points = (f"{title}/ancestor::div[@data-testid='experiment-view-compare-runs-card'][1]"
              "//div[contains(@class, 'js-plotly-plot')]//*[local-name()='path'][@class='point']")  # fmt: skip

    def drawn(d):
        found = d.find_elements(By.XPATH, points)
        return found if len(found) == expected else None

    return len(wait_for(driver, f"{expected} points on the chart {metric}", drawn))


def logged_model_row(driver, name: str, run_id: str) -> str:
    """The model id (the grid's row-id) of the logged models page's one row named
    ``name`` whose source run is ``run_id``."""
    from selenium.webdriver.common.by import By

    def rows(d) -> list[str]:
        ids = [a.find_element(By.XPATH, "./ancestor::div[@role='row'][1]").get_attribute("row-id")
               for a in d.find_elements(By.XPATH, f"//div[@role='row']//a[text()='{name}']")]  # fmt: skip
        # the grid splits a row into a pinned and a scrolled part, one row-id
        return [r for r in ids if d.find_elements(By.XPATH, f"//div[@row-id='{r}']//div"
                f"[@col-id='source_run_id']//a[contains(@href, '{run_id}')]")]  # fmt: skip

    mine = wait_for(driver, f"the logged model {name} of run {run_id}", rows)
    assert len(mine) == 1, f"{len(mine)} rows {name} from run {run_id}: {mine}"
    return mine[0]


def logged_model_metric(driver, model_id: str, key: str) -> float:
    """The value the logged models page shows in row ``model_id``, in the column headed
    ``key``."""
    from selenium.webdriver.common.by import By

    def value(d) -> str | None:
        heads = d.find_elements(By.XPATH, "//div[@role='columnheader'][.//span[contains("
                                f"@class, 'ag-header-cell-text')][text()='{key}']]")  # fmt: skip
        if len(heads) != 1:
            return None
        column = heads[0].get_attribute("aria-colindex")
        cells = d.find_elements(By.XPATH, f"//div[@row-id='{model_id}']//div[@role='gridcell']"
                                f"[@aria-colindex='{column}']")  # fmt: skip
        return next((c.text.strip() for c in cells if c.text.strip()), None)

    return float(wait_for(driver, f"the column {key} of the logged model {model_id}", value))
