"""One media pool per served engine: the OpenAI server prepares its chat prompts' images / video on the engine
driver's media threads (``EngineDriver.media_executor``) instead of a pool of its own beside the driver's, which
then idled (the OpenAI server hands the driver requests whose media are already prepared)."""

import asyncio
import base64
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from m3export.runtime import Engine


def test_openai_chat_media_run_on_the_drivers_only_pool(monkeypatch):
    from m3export.serve.openai_protocol import ChatRequest
    from m3export.serve.openai_server import ApiError, OpenAIServer

    made = []  # the pools the server's objects start (torch keeps pools of its own, made at import)
    init = ThreadPoolExecutor.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self._thread_name_prefix.startswith("openai"):
            made.append(self)

    engine = Engine.from_checkpoint("tiny", num_pages=8, max_model_len=32)
    monkeypatch.setattr(ThreadPoolExecutor, "__init__", counting_init)
    server = OpenAIServer(engine, "tiny")
    server.start()
    try:
        assert made == [server.driver.media_executor], f"{len(made)} thread pools for one engine"
        seen = []

        def chat_prompt(body):  # the decoding work: record where it runs, then stop the request
            seen.append(threading.current_thread())
            raise ApiError("stop here", 400)

        monkeypatch.setattr(server, "_chat_prompt", chat_prompt)
        url = "data:image/png;base64," + base64.b64encode(b"not decoded in this test").decode()
        body = ChatRequest(model="tiny", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}}]}])
        with pytest.raises(ApiError, match="stop here"):
            asyncio.run(server._chat(body, None))
        assert seen and seen[0] in server.driver.media_executor._threads
    finally:
        server.close()
    assert len(made) == 1
