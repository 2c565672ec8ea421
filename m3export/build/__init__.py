"""TensorRT engine building: optimisation profiles and engine metadata (``profiles.py``, plain Python, tested on
the CPU) and the build itself (``engine.py``, needs TensorRT and a GPU)."""
