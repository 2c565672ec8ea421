"""Training the M3 modules in place: the objective (next token + MTP + indexer distillation) and its metrics.

Training runs through the same ``M3ForCausalLM.step`` / ``mtp_step`` that inference and export run; the custom
ops are differentiable through ``m3export.ops.autograd``.
"""
