"""Triton's interpreter (`TRITON_INTERPRET=1`) under NumPy 2.4: it holds a kernel's
scalars as 1-element arrays and turns one into a loop bound with `int(array)`, which
NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"), so
every loop with a runtime bound fails. `patch_scalar_index` makes that conversion take
the one element. Tests and benches that run kernels with such loops on the CPU call it
(a no-op without Triton; this module imports Triton only inside it)."""

from __future__ import annotations


def patch_scalar_index() -> None:
    """Wrap the interpreter's tensor patch so `__index__` reads the one element."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "scalar_index_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.scalar_index_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched
