"""Codec specifications (pure-torch references) and their Triton kernels.

Each `<codec>_ref.py` is the specification; `<codec>_triton.py` beside it must produce the same bytes."""
