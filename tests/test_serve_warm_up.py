"""``serve.triton_model.warm_up`` (the OpenAI server's and Triton model's start-up step): what it runs before the
model is reported ready."""

from __future__ import annotations

import types

import torch

from m3export.serve.triton_model import warm_up


class _Recording:
    """An engine that records the prompts it is asked to generate from."""

    def __init__(self, device: str, budget: int, max_model_len: int):
        self.backend = types.SimpleNamespace(device=torch.device(device))
        self.scheduler = types.SimpleNamespace(max_num_batched_tokens=budget)
        self.max_model_len = max_model_len
        self.prompts = []

    def generate(self, prompts, params):
        assert params.max_tokens == 2 and params.ignore_eos
        self.prompts.extend(len(p) for p in prompts)
        return []


def test_a_gpu_engine_also_prefills_a_full_chunk_and_shorter_ones():
    """On CUDA the kernels of prefill chunks compile during the warm-up, not in the first client's request: a full
    chunk, then a quarter, a sixteenth, ... of it (the MoE prefill tile and the context's bucket change with the
    chunk's size), down to WARM_UP_SHORTEST."""
    engine = _Recording("cuda", budget=8192, max_model_len=131072)
    warm_up(engine)
    assert engine.prompts == [1, 8192, 2048, 512, 128, 32]
    engine = _Recording("cuda", budget=64, max_model_len=131072)
    warm_up(engine)
    assert engine.prompts == [1, 64]  # 16 tokens: a decode-sized batch, as the one-token prompt's


def test_the_chunk_stays_inside_the_context():
    engine = _Recording("cuda", budget=8192, max_model_len=1000)
    warm_up(engine)
    assert engine.prompts == [1, 998, 249, 62]  # room for the two generated tokens


def test_a_cpu_engine_keeps_the_one_token_warm_up():
    engine = _Recording("cpu", budget=8192, max_model_len=131072)
    warm_up(engine)
    assert engine.prompts == [1]


def test_warm_up_runs_on_a_real_engine():
    """The tiny model on the CPU: the one-token prompt is prefilled and its two tokens decoded."""
    from m3export.runtime import Engine
    from m3export.runtime.backends.torch_backend import TorchBackend
    from tests.runtime_fixtures import tiny_model

    engine = Engine(TorchBackend(tiny_model()), page_size=4, num_pages=32, max_model_len=64)
    warm_up(engine)
    assert engine.stats.prefill_tokens == 1 and engine.stats.decode_tokens >= 1
