"""Make Triton 3.6's interpreter (``TRITON_INTERPRET=1``, CPU tensors) run loops with run-time bounds on NumPy >= 2.4.

The interpreter holds scalars as one-element arrays and turns them into loop bounds with ``int(array)``, which
NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"; triton-lang/triton#9171,
fixed after 3.6). Our kernels size their loops from device data (sequence lengths), so under the interpreter
they need the fixed conversion. This wraps the interpreter's tensor patch and changes nothing else; compiled
(GPU) kernels never go through it.
"""

from __future__ import annotations


def apply() -> None:
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_m3_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._m3_fixed = True
    interpreter._patch_lang_tensor = patched
