"""Video through the serving paths: video files (GIF / APNG / WebP through Pillow, MP4 through PyAV when installed)
and frame lists, as Triton's ``video`` input and as OpenAI ``video_url`` data: URLs over HTTP, each equal to the
engine run on the same frames; the frame cap and bad files are one clear error; decoding and preprocessing run off
the engine thread and off the event loop."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from m3export.errors import MediaError
from m3export.preprocess import VideoSettings, preprocess_video
from m3export.preprocess.prompt import VIDEO_TOKEN
from m3export.preprocess.settings import MediaSettings
from m3export.preprocess.video_file import decode_video
from m3export.serve.media import prepare_media
from m3export.serve.protocol import RequestError, parse_request

from .test_serve_media import VISION, _drive, _generate, _png, engine  # noqa: F401  (engine: the fixture)


def _frames(seed: int, n: int = 5, size=(28, 20)) -> list[np.ndarray]:
    """Frames of few flat colours with a moving bar: a GIF's palette holds them exactly."""
    rng = np.random.RandomState(seed)
    colours = rng.randint(0, 256, (n, 3), dtype=np.uint8)
    out = []
    for i in range(n):
        f = np.empty((size[1], size[0], 3), dtype=np.uint8)
        f[:] = colours[i]
        f[:, (3 * i) % size[0]] = 255 - colours[i]
        out.append(f)
    return out


def _animated(frames: list[np.ndarray], fmt: str, duration_ms: int = 250) -> bytes:
    images = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    extra = {"lossless": True} if fmt == "WEBP" else {}
    images[0].save(buf, format=fmt, save_all=True, append_images=images[1:], duration=duration_ms, loop=0, **extra)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["GIF", "PNG", "WEBP"])
def test_animated_images_decode_to_their_frames_and_rate(fmt):
    frames = _frames(1)
    got = decode_video(_animated(frames, fmt, duration_ms=250))
    assert len(got.frames) == len(frames) and got.fps == pytest.approx(4.0)
    for g, want in zip(got.frames, frames):
        assert np.array_equal(g, want)  # lossless formats, colours a GIF palette holds exactly


def test_mp4_decodes_through_pyav():
    av = pytest.importorskip("av", reason="PyAV (the serve extra) decodes MP4 / WebM")
    frames = _frames(2, n=6, size=(64, 48))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        stream = c.add_stream("mpeg4", rate=3)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for f in frames:
            c.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(stream.encode())
    got = decode_video(buf.getvalue())
    assert len(got.frames) == 6 and got.fps == pytest.approx(3.0) and got.frames[0].shape == (48, 64, 3)
    # lossy (yuv420p, mpeg4): each frame stays near its source; neighbours differ by far more
    errors = [np.abs(g.astype(int) - w.astype(int)).mean() for g, w in zip(got.frames, frames)]
    assert max(errors) < 12


def test_frame_cap_and_bad_files_are_one_clear_error(monkeypatch):
    import m3export.preprocess.video_file as video_file

    gif = _animated(_frames(3, n=6), "GIF")
    with pytest.raises(MediaError, match="video: more than 4 frames, the cap on video frames"):
        decode_video(gif, max_frames=4)
    monkeypatch.setattr(video_file, "MAX_VIDEO_PIXELS", 3 * 28 * 20)  # three of these frames
    with pytest.raises(MediaError, match="video: 4 frames of 28 x 20 exceed the decode limit of 1680 pixels"):
        decode_video(gif)
    with pytest.raises(MediaError, match="clip: 4 frames of 28 x 20 exceed the decode limit"):
        video_file.decode_frames([_png_of(f) for f in _frames(3, n=6)], what="clip")
    monkeypatch.undo()
    with pytest.raises(MediaError, match="video: no bytes"):
        decode_video(b"")
    with pytest.raises(MediaError, match="video: (cannot decode the video bytes|not an image sequence Pillow reads)"):
        decode_video(b"\x00\x01 definitely not a video")
    settings = MediaSettings.for_vision(VISION)
    capped = MediaSettings(settings.image, VideoSettings(**{**settings.video.__dict__, "max_frames": 4}))
    from m3export.config import preset

    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    with pytest.raises(MediaError, match="video 0: more than 4 frames"):
        prepare_media(cfg, f"a {VIDEO_TOKEN}", videos=[gif], settings=capped)
    with pytest.raises(MediaError, match="video 0: more than 4 frames, the cap on video frames"):
        prepare_media(cfg, f"a {VIDEO_TOKEN}", videos=[[_png(i) for i in range(6)]], settings=capped)


def test_a_decoded_video_is_preprocessed_as_its_frames(engine):  # noqa: F811
    frames = _frames(4)
    prompt, items = prepare_media(engine.config, f"see {VIDEO_TOKEN}", videos=[_animated(frames, "PNG", 500)])
    settings = MediaSettings.for_vision(VISION)
    want = preprocess_video(np.stack(frames), settings.video, fps=2.0)
    assert torch.equal(items[0].pixel_values, want.pixel_values) and torch.equal(items[0].grid_thw, want.grid_thw)
    assert "]<]0.0 seconds[>[" in prompt and "]<]1.0 seconds[>[" in prompt  # timestamps from the file's rate


def _video_input(elements) -> dict:
    return {"text_input": np.array([f"watch {VIDEO_TOKEN} now".encode()], dtype=object),
            "video": np.array(elements, dtype=object),
            "sampling_parameters": np.array([b'{"temperature": 0, "max_tokens": 4, "ignore_eos": true}'],
                                            dtype=object)}


def test_triton_video_input_file_and_frames_equal_the_engine(engine, monkeypatch):  # noqa: F811
    import m3export.serve.media as media

    frames = _frames(5)
    gif = _animated(frames, "GIF")
    threads = []
    prepare = media.prepare_media
    monkeypatch.setattr(media, "prepare_media", lambda *a, **k: threads.append(threading.current_thread().name)
                        or prepare(*a, **k))
    want = _generate(engine, *prepare_media(engine.config, f"watch {VIDEO_TOKEN} now", videos=[gif]))
    threads.clear()
    for element in (base64.b64encode(gif), gif):  # a file, base64 or raw bytes
        sink = _drive(engine, parse_request(_video_input([element])))
        assert sink.error is None and sink.chunks[-1].token_ids[-4:] == want
    pngs = [base64.b64encode(_png_of(f)).decode() for f in frames]
    sink = _drive(engine, parse_request(_video_input([json.dumps(pngs).encode()])))  # frames, as images
    want_frames = _generate(engine, *prepare_media(engine.config, f"watch {VIDEO_TOKEN} now", videos=[frames]))
    assert sink.error is None and sink.chunks[-1].token_ids[-4:] == want_frames
    assert threads and all(name.startswith("m3-media") for name in threads[:3])  # never the engine thread

    assert "video 0: " in _drive(engine, parse_request(_video_input([base64.b64encode(b"GIF89a broken")]))).error
    with pytest.raises(RequestError, match="input 'video': video: a frame list must be a JSON array"):
        parse_request(_video_input([b"[not json"]))


def _png_of(frame: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(frame).save(buf, format="PNG")
    return buf.getvalue()


def test_openai_video_url_over_http(engine, monkeypatch):  # noqa: F811
    httpx = pytest.importorskip("httpx", reason="httpx comes with the dev extra")
    from m3export.serve.chat_template import ChatTemplate
    from m3export.serve.openai_server import OpenAIServer

    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "test")
    server = OpenAIServer(engine, "vl", chat_template=template, cancel_poll_s=0.0)
    gif = _animated(_frames(6), "GIF")
    threads = []
    chat_prompt = server._chat_prompt
    monkeypatch.setattr(server, "_chat_prompt", lambda body: threads.append(threading.current_thread())
                        or chat_prompt(body))

    def body(url, kind="video_url"):
        return {"model": "vl", "temperature": 0, "max_tokens": 4, "ignore_eos": True, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "what happens"},
                                         {"type": kind, kind: {"url": url}}]}]}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=server.app), base_url="http://vl") as c:
            ok = await c.post("/v1/chat/completions", json=body("data:image/gif;base64," +
                                                                base64.b64encode(gif).decode()))
            bad = await c.post("/v1/chat/completions", json=body("data:video/mp4;base64," +
                                                                 base64.b64encode(b"nope").decode()))
            remote = await c.post("/v1/chat/completions", json=body("https://example.com/v.mp4"))
            return ok, bad, remote, threading.current_thread()

    server.start()
    try:
        ok, bad, remote, loop_thread = asyncio.run(run())
    finally:
        server.close()
    assert ok.status_code == 200, ok.text
    text, items = prepare_media(engine.config, f"user: what happens\n{VIDEO_TOKEN}\n", videos=[gif])
    assert ok.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(text))
    want = engine.tokenizer.decode(_generate(engine, text, items))
    assert ok.json()["choices"][0]["message"]["content"] == want
    assert bad.status_code == 400 and "video 0: " in bad.json()["error"]["message"]
    assert remote.status_code == 400 and "only data: URLs are accepted" in remote.json()["error"]["message"]
    assert threads and all(t is not loop_thread for t in threads)  # media requests: prepared off the event loop
