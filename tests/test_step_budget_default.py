"""The engine's tokens-per-step default follows its device (``runtime.scheduler.default_token_budget``), and the
CLI leaves it to the engine unless ``--max-num-batched-tokens`` is given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from m3export.cli import build_parser
from m3export.commands.arguments import step_budget_engine_args
from m3export.runtime import scheduler
from m3export.runtime.scheduler import default_token_budget

GIB = 2**30


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_cpu_engines_keep_512_tokens_a_step(device):
    assert default_token_budget(device) == scheduler.CPU_TOKEN_BUDGET == 512


@pytest.mark.parametrize("name, gib, expected", [
    ("NVIDIA H200", 141, 8192),
    ("NVIDIA H100 80GB HBM3", 80, 8192),
    ("NVIDIA A100-SXM4-80GB", 80, 2048),  # vLLM: larger budgets lowered A100 throughput
    ("NVIDIA L40S", 48, 2048),
    ("NVIDIA GeForce RTX 4090", 24, 2048),
])
def test_gpu_budget_is_vllms_serving_default_for_the_card(monkeypatch, name, gib, expected):
    seen = []

    def props(device):
        seen.append(device)
        return SimpleNamespace(name=name, total_memory=gib * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert default_token_budget("cuda:1") == expected
    assert seen == [torch.device("cuda:1")]  # the engine's own card, not the current one


def test_engine_without_a_budget_takes_its_backends(monkeypatch):
    """The engine asks its backend: the torch backend takes the device's budget only where the kernels serve
    (streamed prefill attention), any other backend the CPU's; an explicit budget wins."""
    from m3export.config import preset
    from m3export.model import M3ForCausalLM
    from m3export.runtime import Engine
    from m3export.runtime.backends.base import Backend
    from m3export.runtime.backends.torch_backend import TorchBackend

    torch.manual_seed(0)
    be = TorchBackend(M3ForCausalLM(preset("tiny")).eval())
    assert not be.kernels and be.default_max_num_batched_tokens == 512
    eng = Engine(be, num_pages=8, max_model_len=16)
    assert eng.scheduler.max_num_batched_tokens == 512
    eng = Engine(TorchBackend(M3ForCausalLM(preset("tiny")).eval()), num_pages=8, max_model_len=16,
                 max_num_batched_tokens=7)
    assert eng.scheduler.max_num_batched_tokens == 7
    monkeypatch.setattr(scheduler, "default_token_budget", lambda device: 8192)  # as on an H200
    monkeypatch.setattr("m3export.runtime.backends.torch_backend.default_token_budget", lambda device: 8192)
    be.kernels = True
    assert be.default_max_num_batched_tokens == 8192
    assert Backend.default_max_num_batched_tokens.fget(be) == 512  # what the other backends answer


@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt-ids", "1,2"]])
def test_cli_passes_the_budget_only_when_given(command):
    parser = build_parser()
    args = parser.parse_args(command)
    assert args.max_num_batched_tokens is None
    assert step_budget_engine_args(args) == {}
    args = parser.parse_args(command + ["--max-num-batched-tokens", "4096"])
    assert step_budget_engine_args(args) == {"max_num_batched_tokens": 4096}
    with pytest.raises(SystemExit):
        parser.parse_args(command + ["--max-num-batched-tokens", "0"])
