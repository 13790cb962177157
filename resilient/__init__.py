"""Rank side of resilient."""

# The "resilient" torch.distributed backend: registered now if torch.distributed is loaded,
# else the moment it is (no torch import here). See resilient/torch_backend/__init__.py.
from resilient.torch_backend import autoregister as _autoregister_torch_backend  # noqa: E402

_autoregister_torch_backend()
