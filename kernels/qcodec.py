"""The optional C codec of the exact compressed allreduce: :data:`codec` is
``resilient.kernels._qcodec`` (``kernels/qcodec.c``) when it was built and
``RESILIENT_QCODEC`` is not ``0``, else None.

:mod:`resilient.collectives.quantization` calls it for the stages it has (quantize,
dequantize, bucket maxima, packing, and the reduce-scatter's fused receive) on contiguous
CPU tensors of the dtypes it takes, and runs its torch code otherwise: the two give the
same bits and the same wire bytes (``tests/test_qcodec.py``), so members with and
without the extension interoperate. The C side releases the GIL.

Failure behaviour: a malformed ``RESILIENT_QCODEC`` raises
:class:`~resilient.errors.ConfigError` at the first codec call; a missing extension is
not an error (the torch code runs).
"""
from __future__ import annotations

import os
from types import ModuleType

_ext: ModuleType | None
try:
    from resilient.kernels import _qcodec as _ext
except ImportError:   # not built: no C compiler when the package was installed
    _ext = None

#: whether this process has the C codec at all (``RESILIENT_QCODEC`` aside)
BUILT: bool = _ext is not None
_checked = False
_on: ModuleType | None = None


def codec() -> ModuleType | None:
    """The C codec when it is built and not switched off (the setting is read once)."""
    global _checked, _on
    if not _checked:
        from resilient.settings import Settings
        _on = _ext if _ext is not None and Settings.from_env(os.environ).qcodec else None
        _checked = True
    return _on

