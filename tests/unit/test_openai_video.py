"""omni-openai's `video_url` content part (vLLM's): data: URLs always, file:// inside the
allowed directory only, http(s):// only when fetching is on and within the size limit; each
refusal a 400 naming the part (a fake AsyncOmniClient, no Triton; a local HTTP server for
the fetches)."""
from __future__ import annotations

import base64
import http.server
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from omni_client import ModelInfo
from omni_client.openai_server.app import create_app, main
from omni_client.openai_server.media_urls import MediaURLSettings
from tests.unit.test_openai_talker_options import FakeOmni

CLIP = b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8
PARAM = "messages[0].content[1].video_url.url"


def serve(media: MediaURLSettings | None = None):
    app = create_app("triton:8001", media=media)
    front = app.state.front
    front.client = FakeOmni()
    front._models = (time.monotonic() + 3600, [ModelInfo("omni", "omni", "omni_orchestrator"),
                                               ModelInfo("llm", "llm", "omni_llm")])
    return TestClient(app), front


def chat(client: TestClient, *parts: dict, model: str = "omni"):
    content = [{"type": "text", "text": "what happens?"}, *parts]
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": content}]})


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def data_url(data: bytes = CLIP) -> str:
    return "data:video/mp4;base64," + base64.b64encode(data).decode()


def assert_400(response, param: str, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error


# --- data: URLs ------------------------------------------------------------------------------


def test_a_data_url_video_goes_to_the_omni_model_as_its_bytes():
    client, front = serve()
    response = chat(client, video_part(data_url()))

    assert response.status_code == 200, response.text
    (call,) = front.client.calls
    assert call["video"] == CLIP and call["text"] == "what happens?"
    assert call["image"] is None and call["audio"] is None


def test_without_a_video_part_the_call_has_none():
    client, front = serve()
    assert chat(client).status_code == 200
    assert front.client.calls[0]["video"] is None


@pytest.mark.parametrize("part,fragment", [
    (video_part("data:video/mp4;base64,@@not base64@@"), "invalid base64"),
    (video_part("data:video/mp4," + "AAAA"), "must be base64"),
    (video_part("data:video/mp4;base64,"), "holds no bytes"),
    (video_part("ftp://host/clip.mp4"), "unsupported URL scheme 'ftp'"),
    (video_part("clip.mp4"), "unsupported URL scheme"),
])
def test_malformed_video_urls_are_400s_naming_the_url(part, fragment):
    client, front = serve()
    assert_400(chat(client, part), PARAM, fragment)
    assert front.client.calls == []


@pytest.mark.parametrize("part", [
    {"type": "video_url"},
    {"type": "video_url", "video_url": {}},
    {"type": "video_url", "video_url": {"url": 5}},
    {"type": "video_url", "video_url": {"url": data_url(), "fps": 2}},
    {"type": "video_url", "video_url": data_url()},
])
def test_malformed_video_parts_are_400s_naming_the_message_content(part):
    """(pydantic names the content's first alternative, a string, as OpenAI's does)"""
    client, front = serve()
    response = chat(client, part)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith("messages.0.content")
    assert front.client.calls == []


def test_two_videos_in_one_message_are_refused():
    client, _ = serve()
    response = chat(client, video_part(data_url()), video_part(data_url()))
    assert_400(response, "messages[0].content[2]", "at most one video per message")


def test_a_text_only_model_refuses_a_video():
    client, front = serve()
    response = chat(client, video_part(data_url()), model="llm")
    assert_400(response, "messages", "reads text only")
    assert front.client.calls == []


# --- use_audio_in_video (vLLM's mm_processor_kwargs) ------------------------------------------


def chat_with(client: TestClient, kwargs, model: str = "omni"):
    content = [{"type": "text", "text": "what happens?"}, video_part(data_url())]
    return client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": content}],
        "mm_processor_kwargs": kwargs})


@pytest.mark.parametrize("kwargs,flag", [({"use_audio_in_video": True}, True),
                                         ({"use_audio_in_video": False}, False),
                                         ({}, None), (None, None)])
def test_mm_processor_kwargs_use_audio_in_video_goes_to_the_omni_model(kwargs, flag):
    client, front = serve()
    assert chat_with(client, kwargs).status_code == 200
    assert front.client.calls[0]["use_audio_in_video"] is flag


@pytest.mark.parametrize("kwargs,param,fragment", [
    ({"use_audio_in_video": "yes"}, "mm_processor_kwargs.use_audio_in_video", "true or false"),
    ({"fps": 4}, "mm_processor_kwargs.fps", "unsupported processor option 'fps'"),
])
def test_bad_mm_processor_kwargs_are_400s_naming_the_key(kwargs, param, fragment):
    client, front = serve()
    assert_400(chat_with(client, kwargs), param, fragment)
    assert front.client.calls == []


# --- file:// URLs ----------------------------------------------------------------------------


def test_local_files_are_refused_without_an_allowed_directory(tmp_path):
    (tmp_path / "clip.mp4").write_bytes(CLIP)
    client, front = serve()
    response = chat(client, video_part((tmp_path / "clip.mp4").as_uri()))
    assert_400(response, PARAM, "--allowed-local-media-path")
    assert front.client.calls == []


def test_a_local_file_inside_the_allowed_directory_is_read(tmp_path):
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "clip.mp4").write_bytes(CLIP)
    client, front = serve(MediaURLSettings(allowed_local_media_path=tmp_path / "clips"))
    response = chat(client, video_part((tmp_path / "clips" / "clip.mp4").as_uri()))
    assert response.status_code == 200, response.text
    assert front.client.calls[0]["video"] == CLIP


def test_local_files_outside_the_allowed_directory_missing_or_too_big_are_refused(tmp_path):
    clips = tmp_path / "clips"
    clips.mkdir()
    (tmp_path / "secret.mp4").write_bytes(CLIP)
    (clips / "link.mp4").symlink_to(tmp_path / "secret.mp4")
    (clips / "big.mp4").write_bytes(CLIP)
    client, front = serve(MediaURLSettings(allowed_local_media_path=clips,
                                           max_media_bytes=len(CLIP) - 1))
    for url in ((tmp_path / "secret.mp4").as_uri(), f"file://{clips}/../secret.mp4",
                (clips / "link.mp4").as_uri()):
        assert_400(chat(client, video_part(url)), PARAM, "is not inside the allowed directory")
    assert_400(chat(client, video_part((clips / "nope.mp4").as_uri())), PARAM, "cannot read")
    assert_400(chat(client, video_part((clips / "big.mp4").as_uri())), PARAM,
               f"at most {len(CLIP) - 1} are read (--max-media-bytes)")
    assert front.client.calls == []


# --- http(s):// URLs -------------------------------------------------------------------------


@pytest.fixture
def http_clip():
    """A local HTTP server with /clip.mp4 (CLIP) and /missing.mp4 (404); its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path != "/clip.mp4":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "video/mp4")
            self.send_header("Content-Length", str(len(CLIP)))
            self.end_headers()
            self.wfile.write(CLIP)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def test_remote_urls_are_refused_unless_fetching_is_on(http_clip):
    client, front = serve()
    assert_400(chat(client, video_part(f"{http_clip}/clip.mp4")), PARAM, "--allow-remote-media")
    assert front.client.calls == []


def test_with_fetching_on_a_remote_video_is_fetched_within_the_size_limit(http_clip):
    client, front = serve(MediaURLSettings(allow_remote_media=True))
    response = chat(client, video_part(f"{http_clip}/clip.mp4"))
    assert response.status_code == 200, response.text
    assert front.client.calls[0]["video"] == CLIP
    assert_400(chat(client, video_part(f"{http_clip}/missing.mp4")), PARAM, "HTTP 404")
    small, small_front = serve(MediaURLSettings(allow_remote_media=True,
                                                max_media_bytes=len(CLIP) - 1))
    assert_400(chat(small, video_part(f"{http_clip}/clip.mp4")), PARAM,
               f"at most {len(CLIP) - 1} are fetched (--max-media-bytes)")
    assert small_front.client.calls == []


def test_the_allowed_directory_must_exist(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--allowed-local-media-path", str(tmp_path / "nope")])
    assert info.value.code == 2
    assert "--allowed-local-media-path" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not a directory"):
        MediaURLSettings(allowed_local_media_path=Path(tmp_path / "nope"))
