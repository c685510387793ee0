"""The web chat at / in a real browser: headless Chromium (Debian's, `make test-tools`)
driven by Selenium. One browser session and one server (conftest's vision_server, with the voice
where the [tts] extra is installed) for every check: streaming, the stop button freeing the
request on the server, an image attachment, hostile model output shown as inert text, "speak",
the live panel and the conversation kept across a reload. Screenshots are saved under pytest's tmp directory (the path is printed)."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import time

import httpx
import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
except ImportError:  # pragma: no cover - the test extra has it
    webdriver = None

pytestmark = pytest.mark.skipif(
    webdriver is None or not CHROMIUM or not CHROMEDRIVER,
    reason="needs Chromium and chromedriver (apt-get install chromium chromium-driver; "
           "`make test-tools` does it where it can) and selenium")

HOSTILE = "<img src=x onerror=window.pwned=1> [click](javascript:window.pwned=2)"


@pytest.fixture(scope="module")
def server(vision_server):
    return vision_server


@pytest.fixture(scope="module")
def shots(tmp_path_factory):
    path = tmp_path_factory.mktemp("web-chat-screenshots")
    print(f"web chat screenshots in {path}")
    return path


@pytest.fixture(scope="module")
def browser(server):
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1200,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.implicitly_wait(0)
    driver.get(server.url + "/")
    wait_for(lambda: driver.find_element(By.ID, "model").get_attribute("value") == "vlm")
    yield driver
    driver.quit()


def wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the page")


def settle(driver):
    """Waits until no answer is streaming (the Send button is back)."""
    wait_for(lambda: driver.find_element(By.ID, "send").is_displayed())


def last_answer(driver):
    return driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]


def ask(driver, text: str, extra: dict | None = None) -> None:
    settings = driver.find_element(By.ID, "settings")
    if not settings.get_attribute("open"):
        settings.find_element(By.TAG_NAME, "summary").click()
    box = driver.find_element(By.ID, "extra")
    box.clear()
    if extra:
        box.send_keys(json.dumps(extra))
    prompt = driver.find_element(By.ID, "input")
    prompt.send_keys(text)
    driver.find_element(By.ID, "send").click()


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    pattern = re.escape(name) + r"\{[^}]*" + re.escape(labels) + r"[^}]*\}\s+(\S+)"
    return sum(float(v) for v in re.findall(pattern, text))


def test_streams_an_answer_with_its_timings(browser, shots):
    ask(browser, "Hello there", {"max_tokens": 24, "temperature": 0, "ignore_eos": True})
    settle(browser)
    answer = last_answer(browser)
    assert answer.find_element(By.CSS_SELECTOR, ".body").text.strip()
    stats = answer.find_element(By.CSS_SELECTOR, ".stats").text
    assert re.search(r"TTFT \d+ ms · 24 tokens · [\d.]+ tokens/s", stats), stats
    assert "error" not in answer.get_attribute("class")
    # The live panel read /metrics.
    wait_for(lambda: re.fullmatch(r"\d+", browser.find_element(By.ID, "m-running").text))
    assert browser.find_element(By.ID, "m-kv").text.endswith("%")
    browser.save_screenshot(str(shots / "1-streamed.png"))


def test_stop_frees_the_request_on_the_server(browser, server, shots):
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    aborted = metric(server, "loom:request_success_total", 'finished_reason="abort"')
    # Stop is clicked in the page as soon as the answer shows text: the tiny model writes its
    # ~900 tokens in about 0.3 s, less than a poll from here and a WebDriver click may take.
    browser.execute_script("""
        const observer = new MutationObserver(() => {
          const answers = document.querySelectorAll(".msg.assistant");
          const body = answers.length && answers[answers.length - 1].querySelector(".body");
          if (body && body.textContent.trim() && !document.getElementById("stop").hidden) {
            observer.disconnect();
            document.getElementById("stop").click();
          }
        });
        observer.observe(document.getElementById("messages"),
                         { childList: true, subtree: true, characterData: true });
    """)
    ask(browser, "Tell me a long story",
        {"max_tokens": card["max_model_len"] - 100, "ignore_eos": True})
    settle(browser)
    assert "(stopped)" in last_answer(browser).find_element(By.CSS_SELECTOR, ".stats").text
    # The server saw the connection close and aborted the request: nothing runs any more.
    wait_for(lambda: metric(server, "loom:request_success_total",
                            'finished_reason="abort"') == aborted + 1, timeout=30)
    wait_for(lambda: metric(server, "loom:num_requests_running") == 0, timeout=30)
    browser.save_screenshot(str(shots / "2-stopped.png"))


def test_attaches_an_image_for_the_vision_model(browser, tmp_path, shots):
    from PIL import Image

    image = tmp_path / "red.png"
    buffer = io.BytesIO()
    Image.new("RGB", (90, 60), (200, 30, 30)).save(buffer, format="PNG")
    image.write_bytes(buffer.getvalue())
    # A new conversation: the story stopped above can hold most of the model's 1,024
    # positions (a late click on a loaded machine), and sent back as history it would make
    # this request and every later one too long for the model.
    browser.find_element(By.ID, "reset").click()
    wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, ".msg"))
    assert browser.find_element(By.ID, "attach-label").is_displayed()  # a vision model
    picker = browser.find_element(By.ID, "attach")
    browser.execute_script("arguments[0].hidden = false", picker)
    picker.send_keys(str(image))
    wait_for(lambda: "red.png" in browser.find_element(By.ID, "attachments").text)
    ask(browser, "What is in this image?", {"max_tokens": 8, "temperature": 0})
    settle(browser)
    question = browser.find_elements(By.CSS_SELECTOR, ".msg.user")[-1]
    assert question.find_elements(By.CSS_SELECTOR, "img.attachment")
    answer = last_answer(browser)
    assert "error" not in answer.get_attribute("class"), answer.text
    assert "TTFT" in answer.find_element(By.CSS_SELECTOR, ".stats").text
    browser.save_screenshot(str(shots / "3-image.png"))


def test_hostile_model_output_is_inert_text(browser, shots):
    # The model is made to write the markup itself (a grammar of one string), so the page
    # renders real model output, not a test's stand-in.
    schema = {"type": "string", "enum": [HOSTILE]}
    ask(browser, "Say something", {"max_tokens": 64, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "hostile", "schema": schema}}})
    settle(browser)
    body = last_answer(browser).find_element(By.CSS_SELECTOR, ".body")
    assert "<img src=x onerror=window.pwned=1>" in body.text
    assert "[click](javascript:window.pwned=2)" in body.text
    assert not body.find_elements(By.TAG_NAME, "img")
    assert not body.find_elements(By.TAG_NAME, "a")
    time.sleep(0.5)  # (an image's error handler would have run by now)
    assert browser.execute_script("return window.pwned") is None
    browser.save_screenshot(str(shots / "4-hostile.png"))


def test_speak_reads_an_answer_aloud_with_the_served_voice(browser, server):
    voices = [m for m in httpx.get(server.url + "/v1/models").json()["data"]
              if m.get("task") == "speech"]
    if not voices:
        pytest.skip("no voice served (the [tts] extra is not installed)")
    ok = 'handler="/v1/audio/speech",method="POST",status="200"'
    spoken = metric(server, "loom:http_requests_total", ok)
    last_answer(browser).find_element(By.CSS_SELECTOR, "button.speak").click()
    wait_for(lambda: metric(server, "loom:http_requests_total", ok) > spoken, timeout=60)
    time.sleep(0.5)
    assert not browser.find_element(By.ID, "error").is_displayed(), \
        browser.find_element(By.ID, "error").text


def test_the_conversation_is_kept_in_the_browser(browser, shots):
    before = len(browser.find_elements(By.CSS_SELECTOR, ".msg"))
    assert before >= 4  # (the image's and the hostile output's questions and answers)
    browser.refresh()
    wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".msg")) == before)
    browser.find_element(By.ID, "reset").click()
    wait_for(lambda: not browser.find_elements(By.CSS_SELECTOR, ".msg"))
    browser.save_screenshot(str(shots / "5-reset.png"))
    assert os.listdir(shots)
