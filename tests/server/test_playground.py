"""The chat playground (`jaxllm serve`'s page at /) driven in headless Chromium through Selenium,
against a live server on the tiny model whose steps are slowed (tests/helpers/fault_server.py) so that
streaming and stopping can be watched. Needs `chromium` and `chromium-driver` (Debian packages;
`make browser` installs them) and the `selenium` package; without them the tests are skipped
and say so."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from jaxllm import SamplingParams

from tests.helpers.live_server import API_KEY, start_server
from tests.helpers.tiny_model import offline_llm

pytestmark = pytest.mark.browser  # every test here drives headless Chromium

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip(
        "no headless browser: install Debian's chromium and chromium-driver (make browser)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def slow_server(tiny_model_dir, tmp_path_factory):
    """The tiny model behind `jaxllm serve`, each engine step slowed by 30 ms."""
    live = start_server(
        tiny_model_dir,
        str(tmp_path_factory.mktemp("playground")),
        "--log-stats-interval",
        "1",
        faults=["--step-delay", "0.03"],
        offline=lambda: offline_llm(tiny_model_dir),
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def open_page(browser, server, key: str = API_KEY):
    """Load the page and enter `key`; wait until the page shows the served model (or an error)."""
    browser.get(server.url + "/")
    browser.execute_script("localStorage.clear()")
    browser.get(server.url + "/")
    field = browser.find_element(By.ID, "api-key")
    field.clear()
    field.send_keys(key)
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)
    WebDriverWait(browser, 30).until(
        lambda b: b.find_element(By.ID, "model").text != "model: ?" or b.find_element(By.ID, "error").text
    )


def set_value(browser, element_id: str, value) -> None:
    field = browser.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def send(browser, text: str) -> None:
    set_value(browser, "message", text)
    browser.find_element(By.ID, "send").click()


def last_answer(browser):
    return browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def idle(browser) -> bool:
    return browser.find_element(By.ID, "send").is_enabled()


def test_an_answer_streams_in_and_equals_the_engine_s(browser, slow_server, tmp_path):
    open_page(browser, slow_server)
    assert browser.find_element(By.ID, "model").text == f"model: {slow_server.model}"
    set_value(browser, "temperature", 0)
    set_value(browser, "max-tokens", 40)
    send(browser, "Tell me about the sea.")
    # Streaming: part of the answer is on the page while the request still runs.
    WebDriverWait(browser, 60).until(lambda b: last_answer(b).find_element(By.CLASS_NAME, "text").text)
    assert not idle(browser) and browser.find_element(By.ID, "stop").is_enabled()
    partial = last_answer(browser).find_element(By.CLASS_NAME, "text").text
    WebDriverWait(browser, 120).until(idle)
    answer = last_answer(browser)
    expected = slow_server.offline.chat(
        [{"role": "user", "content": "Tell me about the sea."}],
        SamplingParams(temperature=0, max_tokens=40),
        use_tqdm=False,
    )[0]
    # textContent as the page received it (Selenium's .text trims and folds whitespace)
    text = browser.execute_script("return arguments[0].querySelector('.text').textContent", answer)
    assert text == expected.outputs[0].text and len(text) >= len(partial)
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "TTFT" in stats and "40 tokens" in stats and "tok/s" in stats and "finish: length" in stats, stats
    assert browser.find_element(By.ID, "error").text == ""
    browser.save_screenshot(os.environ.get("JAXLLM_PLAYGROUND_SCREENSHOT") or str(tmp_path / "playground.png"))


def test_stop_ends_the_request_on_the_server(browser, slow_server):
    open_page(browser, slow_server)
    set_value(browser, "temperature", 0.7)
    set_value(browser, "max-tokens", 450)
    send(browser, "Write a long story.")
    WebDriverWait(browser, 60).until(lambda b: len(last_answer(b).find_element(By.CLASS_NAME, "text").text) > 20)
    assert slow_server.metrics()[("jaxllm:num_requests_running", ())] == 1
    browser.find_element(By.ID, "stop").click()
    WebDriverWait(browser, 10).until(idle)
    answer = last_answer(browser)
    assert "stopped" in answer.find_element(By.CLASS_NAME, "stats").text
    # The server saw the connection close: the request is aborted and its KV pages are free.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        metrics = slow_server.metrics()
        if metrics[("jaxllm:num_requests_running", ())] == 0 and metrics[("jaxllm:kv_cache_usage_perc", ())] == 0:
            break
        time.sleep(0.2)
    assert metrics[("jaxllm:num_requests_running", ())] == 0 and metrics[("jaxllm:kv_cache_usage_perc", ())] == 0
    shown = answer.find_element(By.CLASS_NAME, "text").text
    time.sleep(1)
    assert answer.find_element(By.CLASS_NAME, "text").text == shown  # nothing more arrives
    assert "client gone" in slow_server.log()  # and the server logged why it ended


def test_structured_output_example_sends_the_schema(browser, slow_server):
    open_page(browser, slow_server)
    set_value(browser, "temperature", 0.7)
    set_value(browser, "max-tokens", 200)
    browser.find_element(By.ID, "json-mode").click()
    send(browser, "Name a big city.")
    WebDriverWait(browser, 120).until(idle)
    answer = last_answer(browser)
    text = browser.execute_script("return arguments[0].querySelector('.text').textContent", answer)
    assert text.startswith('{"city": "'), text  # the grammar's first tokens
    if "finish: stop" in answer.find_element(By.CLASS_NAME, "stats").text:
        value = json.loads(text)
        assert set(value) == {"city", "country", "population_millions"}


def test_a_wrong_key_is_reported_clearly(browser, slow_server):
    open_page(browser, slow_server, key="not-the-key")
    WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "error").text)
    assert browser.find_element(By.ID, "error").text.startswith("401: the API key is missing or wrong")
    send(browser, "Hello")
    WebDriverWait(browser, 10).until(idle)
    assert browser.find_element(By.ID, "error").text.startswith("401")
