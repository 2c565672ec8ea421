"""The Python runtime: paged KV cache, continuous batching, sampling, streaming and MTP speculation.

``Engine`` is the entry point; ``SamplingParams`` configures a request and ``RequestOutput`` reports on it.
"""

from .engine import Engine
from .outputs import RequestOutput
from .params import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
