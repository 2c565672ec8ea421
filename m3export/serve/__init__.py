"""Serving M3: an OpenAI-compatible HTTP server and Triton Inference Server, over one engine driver.

OpenAI API (``m3export serve``): ``openai_server`` (FastAPI app) with ``openai_protocol`` (request bodies),
``openai_metrics`` (Prometheus), ``chat_template`` (the model's Jinja template, rendered as transformers does),
``reasoning_parser`` and ``tool_parser`` (M3's ``<mm:think>`` and tool-call markup, streamed).

Triton: ``repo`` writes the model repository (``m3export triton-repo``); inside Triton, ``triton_model`` runs our
runtime through ``driver`` (continuous batching across requests) with the request contract of ``protocol``
(Triton's vLLM-backend names, shared with the OpenAI server's sampling keys); ``server`` runs the
``tritonserver`` bundled in nvidia-pytriton, with the Python its stub needs from ``stubenv``. Nothing here imports
Triton or torch at package import time.
"""
