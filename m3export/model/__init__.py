"""PyTorch definition of the M3 text backbone and its MTP modules."""

from .batch import Batch
from .m3 import M3ForCausalLM, StepOutput

__all__ = ["Batch", "M3ForCausalLM", "StepOutput"]
