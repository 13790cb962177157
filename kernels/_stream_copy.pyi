# Types of the optional C extension built from kernels/stream_copy.c (see kernels/copy.py).
STREAMING: int

def copy(dst: int, src: int, nbytes: int, /) -> None: ...
