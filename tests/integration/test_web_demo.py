"""The web demo (omni-openai's `/`) in headless Chromium, against the real omni-chat stack.

Debian's chromium and chromium-driver (tools/setup.sh installs them) driven by
selenium: the page is loaded from the `omni-openai` process of the
`openai_frontend` fixture, which sits in front of the session's omni-chat
tritonserver. What the page sends is recorded in the browser (a fetch
wrapper) and replayed, non-streamed, through the same endpoint: the streamed
reply on the page must equal the whole completion, and the WAV the page built
from the streamed PCM chunks must be the whole completion's speech.
"""
from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import soundfile as sf
from PIL import Image, ImageDraw

from omni_client.openai_server.realtime.vad import ServerVad
from tests.speech_clip import sound_spans, turns

from .omni_io import tone, wav

pytestmark = pytest.mark.integration

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# docs/openai-api.md shows it; written only when missing (delete it to take a new one), so
# a test run never rewrites a tracked file
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "web-demo.png"
WINDOW = (1100, 800)
STREAM_TIMEOUT_S = 300  # omni-chat with speech on two CPU cores, the first request warming up

# Records the body of every POST the page makes (the replay below sends the same).
_RECORD_FETCH = """
window.__sent = [];
const original = window.fetch;
window.fetch = function (url, options) {
  if (options && options.body) window.__sent.push({url: String(url), body: options.body});
  return original.apply(this, arguments);
};
"""

# The bytes of a blob: URL, as base64 (async script: the callback is the last argument).
_BLOB_BYTES = """
const done = arguments[arguments.length - 1];
fetch(arguments[0]).then((r) => r.arrayBuffer()).then((buf) => {
  const u = new Uint8Array(buf);
  let s = "";
  for (let i = 0; i < u.length; i += 0x8000) s += String.fromCharCode.apply(null, u.subarray(i, i + 0x8000));
  done(btoa(s));
}).catch((e) => done("ERROR " + e));
"""


def _chromium(tmp_path_factory, *extra_flags: str):
    """Debian's chromium, headless, under chromedriver, its viewport at WINDOW."""
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} missing (Debian's chromium and chromium-driver; "
                    "tools/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tmp_path_factory.mktemp("chromium-profile")
    # The flags this closed network needs (without them Chromium keeps dialing out, or hangs).
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
                 f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}", *extra_flags):
        options.add_argument(flag)
    log = tmp_path_factory.mktemp("chromedriver") / "chromedriver.log"
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER), log_output=str(log)),
                              options=options)
    try:
        # The viewport itself at WINDOW (--window-size counts the window, not the page).
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": WINDOW[0], "height": WINDOW[1], "deviceScaleFactor": 1,
                                "mobile": False})
        driver.set_script_timeout(60)
    except Exception:
        driver.quit()
        raise
    return driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    driver = _chromium(tmp_path_factory)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def page(browser, openai_frontend):
    """The demo freshly loaded, its model list filled, its requests recorded."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{openai_frontend}/")
    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return document.getElementById('model').dataset.loaded") == "true")
    browser.execute_script(_RECORD_FETCH)
    return browser


# --- helpers ---------------------------------------------------------------------------

def _by_id(driver, id_: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, id_)


def _set(driver, id_: str, value: str) -> None:
    box = _by_id(driver, id_)
    box.clear()
    box.send_keys(value)


def _select(driver, id_: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(_by_id(driver, id_)).select_by_value(value)


def _text(driver, id_: str) -> str:
    return driver.execute_script(f"const e = document.getElementById('{id_}'); "
                                 "return e ? e.textContent : null")


def _wait_finished(driver, timeout: float = STREAM_TIMEOUT_S) -> list[int]:
    """Wait until #status is done (or error); return #reply's lengths sampled meanwhile."""
    lengths: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, length = driver.execute_script(
            "const r = document.getElementById('reply');"
            "return [document.getElementById('status').textContent, r ? r.textContent.length : -1]")
        lengths.append(length)
        if state in ("done", "error"):
            return lengths
        time.sleep(0.05)
    raise AssertionError(f"the page did not finish in {timeout}s; status {_text(driver, 'status')!r}, "
                         f"reply {_text(driver, 'reply')!r}")


def _sent(driver, path: str) -> list[dict]:
    return [json.loads(r["body"]) for r in driver.execute_script("return window.__sent")
            if r["url"].endswith(path)]


def _picture() -> bytes:
    """A small drawn scene (a sun over the sea): the screenshot's attached image."""
    im = Image.new("RGB", (160, 110), (135, 196, 235))
    draw = ImageDraw.Draw(im)
    draw.rectangle((0, 70, 160, 110), fill=(40, 110, 170))
    draw.ellipse((100, 18, 136, 54), fill=(255, 205, 60))
    draw.polygon([(20, 78), (60, 78), (44, 58)], fill=(250, 250, 250))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def _whole(base_url: str, body: dict) -> dict:
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=STREAM_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def _screenshot(driver, *paths: Path) -> None:
    png = driver.get_screenshot_as_png()
    assert Image.open(io.BytesIO(png)).size == WINDOW
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)


# --- tests -----------------------------------------------------------------------------

def test_chat_streams_the_reply_and_speaks_it(page, openai_frontend, tmp_path):
    image_path, audio_path = tmp_path / "beach.png", tmp_path / "hello.wav"
    image_path.write_bytes(_picture())
    audio_path.write_bytes(wav(tone(1.5)))

    _select(page, "model", "omni")
    _set(page, "temperature", "0")
    _set(page, "seed", "7")
    _set(page, "max-tokens", "24")
    _by_id(page, "image-file").send_keys(str(image_path))
    _by_id(page, "audio-file").send_keys(str(audio_path))
    _by_id(page, "prompt").send_keys("What do you see and hear?")
    _by_id(page, "speak").click()
    _by_id(page, "send").click()
    lengths = _wait_finished(page)

    assert _text(page, "status") == "done", _text(page, "error")
    assert _by_id(page, "error").get_attribute("hidden") is not None  # no error shown
    reply = _text(page, "reply")
    assert reply.strip()
    # It streamed: the reply was rendered delta by delta (and never shrank while sampled).
    deltas = int(_by_id(page, "reply").get_attribute("data-deltas"))
    assert deltas > 1, f"one text delta only ({reply!r})"
    seen = [n for n in lengths if n >= 0]
    assert seen == sorted(seen), seen

    # What the page sent: the OpenAI shape, with the media as parts of the user message.
    [sent] = _sent(page, "/v1/chat/completions")
    assert sent["stream"] is True and sent["model"] == "omni"
    assert sent["temperature"] == 0 and sent["seed"] == 7 and sent["max_tokens"] == 24
    assert sent["modalities"] == ["text", "audio"] and sent["audio"]["format"] == "pcm16"
    [user] = sent["messages"]
    parts = {p["type"]: p for p in user["content"]}
    assert parts["text"]["text"] == "What do you see and hear?"
    assert parts["image_url"]["image_url"]["url"] == (
        "data:image/png;base64," + base64.b64encode(image_path.read_bytes()).decode())
    assert parts["input_audio"]["input_audio"] == {
        "data": base64.b64encode(audio_path.read_bytes()).decode(), "format": "wav"}

    # The same request, whole: the same text, and the same speech as the page's WAV.
    whole = _whole(openai_frontend, {**sent, "stream": False})
    message = whole["choices"][0]["message"]
    assert message["audio"]["transcript"] == reply
    expected = np.frombuffer(base64.b64decode(message["audio"]["data"]), "<i2")  # raw pcm16

    src = _by_id(page, "audio-player").get_attribute("src")
    assert src and src.startswith("blob:")
    blob = page.execute_async_script(_BLOB_BYTES, src)
    assert not blob.startswith("ERROR"), blob
    samples, rate = sf.read(io.BytesIO(base64.b64decode(blob)), dtype="int16")
    assert rate == 24000 and samples.ndim == 1 and samples.size > 0
    assert samples.size == expected.size
    assert np.abs(samples.astype(np.int32) - expected.astype(np.int32)).max() <= 33  # ~1e-3

    _screenshot(page, tmp_path / "web-demo.png", *([] if SCREENSHOT.exists() else [SCREENSHOT]))


def test_follow_up_turn_sends_the_conversation(page, openai_frontend):
    _select(page, "model", "omni")
    _set(page, "temperature", "0")
    _set(page, "seed", "3")
    _set(page, "max-tokens", "6")
    for prompt in ("hello", "and then?"):
        _by_id(page, "prompt").send_keys(prompt)
        _by_id(page, "send").click()
        _wait_finished(page)
        assert _text(page, "status") == "done", _text(page, "error")

    first, second = _sent(page, "/v1/chat/completions")
    assert first["messages"] == [{"role": "user", "content": "hello"}] and "modalities" not in first
    replies = page.execute_script(
        "return [...document.querySelectorAll('.message.assistant .text')].map(e => e.textContent)")
    assert len(replies) == 2 and all(replies)
    # earlier turns go back as text
    assert second["messages"] == [{"role": "user", "content": "hello"},
                                  {"role": "assistant", "content": replies[0]},
                                  {"role": "user", "content": "and then?"}]
    whole = _whole(openai_frontend, {**second, "stream": False})
    assert whole["choices"][0]["message"]["content"] == _text(page, "reply") == replies[1]


def test_image_mode_shows_the_generated_picture(page, openai_frontend, tmp_path):
    _set(page, "seed", "11")
    _set(page, "image-size", "64x64")
    _by_id(page, "prompt").send_keys("a red square")
    _by_id(page, "generate-image").click()
    _wait_finished(page)
    assert _text(page, "status") == "done", _text(page, "error")

    size = page.execute_script(
        "const i = document.getElementById('generated-image');"
        "return i && i.complete ? [i.naturalWidth, i.naturalHeight] : null")
    assert size == [64, 64]
    [sent] = _sent(page, "/v1/images/generations")
    assert sent == {"prompt": "a red square", "n": 1, "size": "64x64",
                    "response_format": "b64_json", "model": "text_to_image", "seed": 11}
    direct = requests.post(f"{openai_frontend}/v1/images/generations", json=sent, timeout=120)
    assert direct.status_code == 200, direct.text
    src = _by_id(page, "generated-image").get_attribute("src")
    assert src == "data:image/png;base64," + direct.json()["data"][0]["b64_json"]  # seeded
    _screenshot(page, tmp_path / "web-demo-image.png")


def test_errors_from_the_server_are_shown(page, tmp_path):
    image_path = tmp_path / "beach.png"
    image_path.write_bytes(_picture())
    _select(page, "model", "llm")  # a text-only model: the server refuses the image
    _by_id(page, "image-file").send_keys(str(image_path))
    _by_id(page, "prompt").send_keys("what is this")
    _by_id(page, "send").click()
    _wait_finished(page, timeout=60)

    assert _text(page, "status") == "error"
    assert "reads text only" in _text(page, "error")
    assert _by_id(page, "error").is_displayed()
    assert _text(page, "reply") is None  # no empty assistant bubble is left behind


def test_a_video_goes_as_a_data_url_and_a_refusal_is_shown(page, tmp_path):
    """An uploaded clip is sent as a video_url part (a data: URL of the file); this one is
    no video, so the server refuses it naming `video`, and the page shows that."""
    clip_path = tmp_path / "clip.mp4"
    clip_path.write_bytes(np.random.default_rng(0).bytes(3000))
    _select(page, "model", "omni")
    _by_id(page, "video-file").send_keys(str(clip_path))
    assert "video: clip.mp4" in _text(page, "attachments")
    _by_id(page, "prompt").send_keys("what happens?")
    _by_id(page, "send").click()
    _wait_finished(page, timeout=60)

    [sent] = _sent(page, "/v1/chat/completions")
    parts = {p["type"]: p for p in sent["messages"][-1]["content"]}
    assert parts["video_url"]["video_url"]["url"] == (
        "data:video/mp4;base64," + base64.b64encode(clip_path.read_bytes()).decode())
    assert _text(page, "status") == "error"
    assert "video" in _text(page, "error") and _by_id(page, "error").is_displayed()
    assert _text(page, "reply") is None
    assert _by_id(page, "video-file").get_attribute("value") == ""  # the composer is cleared


def test_the_demo_is_served_by_omni_openai(openai_frontend):
    index = requests.get(f"{openai_frontend}/", timeout=10)
    assert index.status_code == 200 and 'id="send"' in index.text
    for asset in ("app.js", "style.css"):
        assert requests.get(f"{openai_frontend}/static/{asset}", timeout=10).status_code == 200


# --- voice mode (/v1/realtime) ------------------------------------------------------------

VOICE_WORDS = "Hello there, how are you today?"

# Records the page's realtime socket (every message each way), every buffer of sound it
# schedules for playback (samples, start time) and the audio clock whenever it stops one.
# With window.__wsHost set, the socket goes to that host:port instead.
_RECORD_VOICE = """
window.__ws = {url: null, sent: [], received: []};
window.__played = [];
window.__stoppedAt = [];
const NativeWebSocket = window.WebSocket;
function RecordedWebSocket(url, protocols) {
  window.__ws.url = String(url);
  if (window.__wsHost) url = String(url).replace(/\\/\\/[^/]+/, "//" + window.__wsHost);
  const ws = protocols === undefined ? new NativeWebSocket(url) : new NativeWebSocket(url, protocols);
  const send = ws.send.bind(ws);
  ws.send = (data) => { window.__ws.sent.push(data); send(data); };
  ws.addEventListener("message", (ev) => window.__ws.received.push(ev.data));
  return ws;
}
RecordedWebSocket.prototype = NativeWebSocket.prototype;
for (const k of ["CONNECTING", "OPEN", "CLOSING", "CLOSED"]) RecordedWebSocket[k] = NativeWebSocket[k];
window.WebSocket = RecordedWebSocket;
const start = AudioBufferSourceNode.prototype.start;
AudioBufferSourceNode.prototype.start = function () {
  const ch = this.buffer.getChannelData(0);
  window.__played.push({pcm: Array.from(ch, (x) => Math.round(x * 32768)), when: arguments[0] || 0,
                        seconds: this.buffer.duration});
  return start.apply(this, arguments);
};
const stop = AudioBufferSourceNode.prototype.stop;
AudioBufferSourceNode.prototype.stop = function () {
  window.__stoppedAt.push(this.context.currentTime);
  return stop.apply(this, arguments);
};
"""


@pytest.fixture(scope="module")
def voice_browser(tmp_path_factory):
    """Chromium whose microphone is a WAV of spoken words (espeak-ng), played once."""
    clip = turns([VOICE_WORDS], lead_ms=1000, tail_ms=4000, rate=48000)
    path = tmp_path_factory.mktemp("fake-microphone") / "words.wav"
    path.write_bytes(clip.wav())
    driver = _chromium(tmp_path_factory, "--use-fake-ui-for-media-stream",
                       "--use-fake-device-for-media-stream",
                       f"--use-file-for-fake-audio-capture={path}%noloop")
    try:
        yield driver, clip
    finally:
        driver.quit()


def _open_voice_page(driver, base_url: str, ws_host: str | None = None) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"{base_url}/")
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.getElementById('model').dataset.loaded") == "true")
    driver.execute_script(_RECORD_VOICE)
    if ws_host:
        driver.execute_script("window.__wsHost = arguments[0]", ws_host)


def _events(driver, key: str) -> list[dict]:
    return [json.loads(m) for m in driver.execute_script(f"return window.__ws.{key}")]


def _played(driver) -> list[dict]:
    return driver.execute_script("return window.__played")


def _wait_for_event(driver, kind: str, count: int = 1, timeout: float = STREAM_TIMEOUT_S) -> list[dict]:
    """The events the page received, once `count` of type `kind` are among them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        received = _events(driver, "received")
        if sum(e["type"] == kind for e in received) >= count:
            return received
        time.sleep(0.1)
    kinds = [e["type"] for e in _events(driver, "received")]
    raise AssertionError(f"no {kind} in {timeout}s; received {kinds}, error {_text(driver, 'error')!r}")


def test_voice_mode_answers_the_microphone_in_speech(voice_browser, openai_frontend):
    driver, clip = voice_browser
    _open_voice_page(driver, openai_frontend)
    _select(driver, "model", "omni")
    _set(driver, "seed", "7")
    _set(driver, "max-tokens", "64")
    _by_id(driver, "voice-mode").click()
    received = _wait_for_event(driver, "response.done")
    sent = _events(driver, "sent")
    kinds = [e["type"] for e in received]

    # The page opened the socket for the chosen model and turned server VAD on before any audio.
    assert driver.execute_script("return window.__ws.url").endswith("/v1/realtime?model=omni")
    update, *appends = sent
    assert update["type"] == "session.update"
    assert update["session"]["audio"]["input"]["turn_detection"] == {"type": "server_vad"}
    assert update["session"]["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert {e["type"] for e in appends} == {"input_audio_buffer.append"}
    assert kinds.index("session.updated") < kinds.index("input_audio_buffer.speech_started")

    # The microphone's words are in what the page sent, as long as they are in the WAV, and the
    # server heard them there: its VAD events are where this process's VAD puts them.
    pcm = np.frombuffer(b"".join(base64.b64decode(e["audio"]) for e in appends), "<i2")
    start, end = sound_spans(pcm, 24000)[0]
    spoken = clip.spans[0][1] - clip.spans[0][0]
    assert abs((end - start) - spoken) < 250, (start, end, spoken)
    heard = [(e.kind, e.audio_ms) for e in ServerVad().feed(pcm.tobytes())]
    server = [(e["type"].split(".")[-1], e.get("audio_start_ms", e.get("audio_end_ms")))
              for e in received if e["type"].startswith("input_audio_buffer.speech_")]
    assert len(server) >= 2 and server == heard[: len(server)], (server, heard)

    # Then a spoken reply: the turn's events in order, the response not cut short by anything
    # but its token limit.
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "response.created", "response.output_audio.delta",
             "response.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
    done = next(e for e in received if e["type"] == "response.done")["response"]
    assert done["status"] == "completed" or (done["status"], done["status_details"]["reason"]) == (
        "incomplete", "max_output_tokens"), done
    deltas = [e for e in received if e["type"] == "response.output_audio.delta"]
    assert {e["response_id"] for e in deltas} == {done["id"]}
    speech = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in deltas), "<i2")
    assert speech.size > 0.1 * 24000, speech.size

    # The page played exactly that speech, and shows the transcript that came with it.
    played = np.concatenate([np.asarray(b["pcm"], np.int64) for b in _played(driver)])
    assert played.size == speech.size
    assert np.abs(played - speech.astype(np.int64)).max() <= 1
    transcript = "".join(e["delta"] for e in received
                         if e["type"] == "response.output_audio_transcript.delta")
    assert transcript.strip() and _text(driver, "voice-reply") == transcript
    assert _by_id(driver, "error").get_attribute("hidden") is not None, _text(driver, "error")
    _by_id(driver, "voice-mode").click()  # end the session


# A scripted /v1/realtime for the barge-in test: the omni tiny model's replies are a fraction
# of a second, too short to talk over on cue, so this server sends a long reply, then the
# user's speech_started while it plays, then late deltas of the cut reply, then a new reply.
CUT_CHUNKS, LATE_CHUNKS, NEXT_CHUNKS, CHUNK = 10, 3, 2, 12000  # 0.5 s chunks at 24 kHz


def _chunk(i: int) -> np.ndarray:
    """Chunk i of a reply: a tone whose loudness says which chunk it is."""
    t = np.arange(CHUNK) / 24000
    return np.round((1000 + 500 * i) * np.sin(2 * np.pi * 220 * t)).astype("<i2")


def _scripted_realtime(ws) -> None:
    def send(type_: str, **fields) -> None:
        ws.send(json.dumps({"type": type_, "event_id": f"event_{time.monotonic_ns()}", **fields}))

    def audio(response: str, i: int, words: str) -> None:
        send("response.output_audio_transcript.delta", response_id=response, delta=words)
        send("response.output_audio.delta", response_id=response,
             delta=base64.b64encode(_chunk(i).tobytes()).decode())

    send("session.created", session={"id": "sess_1"})
    while json.loads(ws.recv())["type"] != "session.update":
        pass
    send("session.updated", session={"id": "sess_1"})
    send("response.created", response={"id": "resp_cut"})
    for i in range(CUT_CHUNKS):
        audio("resp_cut", i, f"cut{i} ")
    send("input_audio_buffer.speech_started", audio_start_ms=1000, item_id="item_2")
    for i in range(CUT_CHUNKS, CUT_CHUNKS + LATE_CHUNKS):  # sent before the server heard it
        audio("resp_cut", i, f"late{i} ")
    send("response.done", response={"id": "resp_cut", "status": "cancelled"})
    send("input_audio_buffer.speech_stopped", audio_end_ms=2500, item_id="item_2")
    send("response.created", response={"id": "resp_next"})
    for i in range(NEXT_CHUNKS):
        audio("resp_next", 20 + i, f"next{i} ")
    send("response.done", response={"id": "resp_next", "status": "completed"})
    for _ in ws:  # the page's microphone, until it leaves
        pass


@pytest.fixture
def scripted_realtime():
    """host:port of a WebSocket server that runs _scripted_realtime per connection."""
    import threading

    from websockets.sync.server import serve

    with serve(_scripted_realtime, "127.0.0.1", 0) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield "127.0.0.1:%d" % server.socket.getsockname()[1]
        server.shutdown()
    thread.join(timeout=10)


def test_voice_mode_stops_the_reply_when_the_user_talks(voice_browser, openai_frontend,
                                                        scripted_realtime):
    driver, _ = voice_browser
    _open_voice_page(driver, openai_frontend, ws_host=scripted_realtime)
    _select(driver, "model", "omni")
    _by_id(driver, "voice-mode").click()
    _wait_for_event(driver, "response.done", count=2, timeout=60)

    # Played: the cut reply's chunks up to the user's speech, none of its late ones, then the
    # next reply's; the cut reply's sound was stopped before it had played out, and the next
    # reply starts at once, not after where the cut one would have ended.
    played = _played(driver)
    expected = list(range(CUT_CHUNKS)) + [20 + i for i in range(NEXT_CHUNKS)]
    assert len(played) == len(expected)
    for buffer, i in zip(played, expected):
        assert np.array_equal(np.asarray(buffer["pcm"]), _chunk(i)), i
    cut_end = played[0]["when"] + CUT_CHUNKS * CHUNK / 24000
    stopped_at = driver.execute_script("return window.__stoppedAt")
    assert len(stopped_at) >= 1 and max(stopped_at) < cut_end, (stopped_at, cut_end)
    assert played[CUT_CHUNKS]["when"] < cut_end - 1.0

    # Shown: the cut reply as far as it got, marked interrupted; the user's turn; the next reply.
    bubbles = driver.execute_script(
        "return [...document.querySelectorAll('.message')].map(m => [m.className, "
        "m.querySelector('.text').textContent])")
    assert bubbles == [
        ["message assistant interrupted", "".join(f"cut{i} " for i in range(CUT_CHUNKS))],
        ["message user", "🎤 spoken (1.5 s)"],
        ["message assistant", "next0 next1 "],
    ], bubbles
    assert _text(driver, "voice-reply") == "next0 next1 "
    _by_id(driver, "voice-mode").click()
