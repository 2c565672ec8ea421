"""Images through the serving paths: Triton's ``image`` input (base64 or raw bytes) and OpenAI ``image_url`` data:
URLs both reach the engine as the same media, with the prompt's marker expanded; bad images are one clear error.

The engine is a tiny VL model whose byte-level tokenizer also knows the image markers as single tokens (as the
release's tokenizer does), so a text prompt's marker expands to placeholders that tokenize to image_token_index.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from m3export.config import VisionConfig, preset
from m3export.errors import MediaError
from m3export.model import M3ForCausalLM
from m3export.preprocess import ImageSettings, preprocess_images
from m3export.preprocess.prompt import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START
from m3export.runtime import Engine, SamplingParams
from m3export.runtime.backends.torch_backend import TorchBackend
from m3export.runtime.tokenizer import TextTokenizer
from m3export.serve.driver import EngineDriver
from m3export.serve.media import prepare_images
from m3export.serve.protocol import RequestError, parse_request
from m3export.tokenizer import byte_level_tokenizer

# The byte-level tokenizer holds ids 0-258; the four markers get the next ids, in this order.
VISION = VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      patch_size=4, image_token_index=259, video_token_index=260, projector_hidden_size=48)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    cfg = preset("tiny").replace(num_mtp_modules=0, vision=VISION)
    torch.manual_seed(0)
    model = M3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    tok = byte_level_tokenizer(cfg)
    tok.add_special_tokens([IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END])
    assert tok.token_to_id(IMAGE_TOKEN) == VISION.image_token_index
    return Engine(TorchBackend(model.double()), TextTokenizer(tok), page_size=4, num_pages=64)


def _png(seed=0, size=(40, 30)) -> bytes:
    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.randint(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _generate(engine, prompt, media) -> list[int]:
    engine.add_request("ref", prompt, GREEDY, media=media)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    return out.token_ids


def test_image_input_accepts_base64_and_raw_bytes():
    png = _png()
    for element in (base64.b64encode(png), png, base64.b64encode(png).decode()):
        req = parse_request({"text_input": np.array([b"a " + IMAGE_TOKEN.encode()], dtype=object),
                             "image": np.array([element], dtype=object)})
        assert req.images == (png,)
    with pytest.raises(RequestError, match="input 'image': image: neither base64 text nor an encoded image"):
        parse_request({"text_input": np.array([b"x"], dtype=object), "image": np.array([b"not base64!"],
                                                                                      dtype=object)})


def test_prepare_images_expands_the_marker(engine):
    prompt, items = prepare_images(engine.config, f"look: {IMAGE_TOKEN} ok", [_png()])
    grid = items[0].grid_thw
    settings = ImageSettings.for_vision(VISION)
    pixels, want_grid = preprocess_images([_png()], settings)
    assert torch.equal(grid, want_grid) and torch.equal(items[0].pixel_values, pixels)
    n = int(grid.prod()) // VISION.merge_unit
    assert prompt == f"look: {VISION_START}{IMAGE_TOKEN * n}{VISION_END} ok"
    assert engine.tokenizer.encode(prompt).count(VISION.image_token_index) == n
    with pytest.raises(MediaError, match="the prompt marks 0 image.s. with .* but 1 image.s. were sent"):
        prepare_images(engine.config, "no marker", [_png()])
    with pytest.raises(MediaError, match="image 1: cannot decode the image bytes"):
        prepare_images(engine.config, IMAGE_TOKEN * 2, [_png(), b"\x89PNG broken"])
    with pytest.raises(MediaError, match="no vision tower"):
        prepare_images(preset("tiny"), IMAGE_TOKEN, [_png()])


class _ListSink:
    def __init__(self):
        self.chunks, self.error, self.done = [], None, False

    def send(self, chunk):
        self.chunks.append(chunk)
        self.done = self.done or chunk.final

    def fail(self, message):
        self.error, self.done = message, True

    def close(self):
        self.done = True

    def cancelled(self):
        return False


def _drive(engine, request):
    import time

    driver = EngineDriver(engine, cancel_poll_s=0.0, idle_wait_s=0.02)
    sink = _ListSink()
    try:
        driver.submit(request, sink)
        deadline = time.monotonic() + 60
        while not sink.done:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        driver.close()
    return sink


def test_triton_request_with_an_image_equals_the_engine(engine):
    text = f"describe {IMAGE_TOKEN}"
    req = parse_request({"text_input": np.array([text.encode()], dtype=object),
                         "image": np.array([base64.b64encode(_png(1))], dtype=object),
                         "sampling_parameters": np.array([b'{"temperature": 0, "max_tokens": 4, "ignore_eos": true}'],
                                                         dtype=object)})
    sink = _drive(engine, req)
    assert sink.error is None
    prompt, items = prepare_images(engine.config, text, [_png(1)])
    assert sink.chunks[-1].token_ids[-4:] == _generate(engine, prompt, items)

    bad = parse_request({"text_input": np.array([b"two " + IMAGE_TOKEN.encode() * 2], dtype=object),
                         "image": np.array([base64.b64encode(_png(1))], dtype=object)})
    assert "the prompt marks 2 image(s)" in _drive(engine, bad).error


def test_openai_chat_with_a_data_url_image(engine):
    from m3export.serve.chat_template import ChatTemplate
    from m3export.serve.openai_protocol import ChatRequest
    from m3export.serve.openai_server import ApiError, OpenAIServer

    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "test")
    server = OpenAIServer(engine, "vl", chat_template=template)
    url = "data:image/png;base64," + base64.b64encode(_png(2)).decode()
    body = ChatRequest(model="vl", messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}}]}])
    prompt, _ = server._chat_prompt(body)
    want_text, want_items = prepare_images(engine.config, f"user: what is\n{IMAGE_TOKEN}\n", [_png(2)])
    assert prompt.ids == engine.tokenizer.encode(want_text)
    assert len(prompt.media) == 1 and torch.equal(prompt.media[0].pixel_values, want_items[0].pixel_values)

    for bad_url, message in (("https://example.com/cat.png", "only data: URLs are accepted"),
                             ("data:text/plain;base64,aGk=", "not an image"),
                             ("data:image/png;base64,@@@", "does not decode")):
        body = ChatRequest(model="vl", messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": bad_url}}]}])
        with pytest.raises(ApiError, match=message):
            server._chat_prompt(body)


def test_llm_generate_with_multi_modal_data(engine):
    """vLLM's offline shape: {"prompt": ..., "multi_modal_data": {"image": ..., "video": ...}}."""
    from m3export.llm import LLM
    from m3export.serve.media import prepare_media

    llm = object.__new__(LLM)
    llm.engine = engine
    frames = np.random.RandomState(5).randint(0, 256, (3, 20, 28, 3), dtype=np.uint8)
    image = Image.open(io.BytesIO(_png(3)))
    prompt = f"a {IMAGE_TOKEN} then {VIDEO_TOKEN} end"
    got = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image, "video": frames}}, GREEDY)[0]
    expanded, items = prepare_media(engine.config, prompt, [image], [frames])
    assert [it.kind for it in items] == ["image", "video"]
    assert engine.tokenizer.encode(expanded).count(VISION.video_token_index) == items[1].num_tokens(4)
    assert got.outputs[0].token_ids == _generate(engine, expanded, items)
    plain = llm.generate("no media here", GREEDY)[0]  # plain prompts are unchanged
    assert len(plain.outputs[0].token_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="multi_modal_data takes 'image' and 'video'"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": 1}}, GREEDY)
