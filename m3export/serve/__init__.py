"""Serving M3 with Triton Inference Server.

``repo`` writes the model repository (``m3export triton-repo``); inside Triton, ``triton_model`` runs our runtime
through ``driver`` (continuous batching across requests) with the request contract of ``protocol`` (Triton's
vLLM-backend names); ``server`` runs the ``tritonserver`` bundled in nvidia-pytriton, with the Python its stub
needs from ``stubenv``. Nothing here imports Triton or torch at package import time.
"""
