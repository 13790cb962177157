"""resilient.errors: every error exported from the package root; cancellation signals that
`except Exception` cannot swallow; the compatibility bases (pure logic)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import resilient
from resilient import errors

ROOT = Path(__file__).resolve().parent.parent


def test_every_error_of_the_module_is_exported_from_the_package_root():
    defined = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__}
    assert defined == set(errors.__all__)
    assert set(errors.__all__) <= set(resilient.__all__)
    for name in errors.__all__:
        assert getattr(resilient, name) is getattr(errors, name)


def test_the_moved_errors_keep_their_old_import_paths():
    """The moved errors are the same objects under their old import paths."""
    from resilient.collectives import retry
    from resilient.coordinator import epoch
    from resilient.elastic import state
    from resilient.launcher import rendezvous

    assert retry.PeerUnreachable is errors.PeerUnreachable
    assert epoch.EpochChanged is resilient.coordinator.EpochChanged is errors.EpochChanged
    assert state.TrainingFinished is resilient.elastic.TrainingFinished is errors.TrainingFinished
    assert rendezvous.RendezvousTimeout is errors.RendezvousTimeout


@pytest.mark.parametrize("signal", [errors.EpochChanged("newer", 3, {}), errors.TransportAborted("aborted")])
def test_a_cancellation_signal_passes_a_broad_handler_and_is_caught_by_name(signal):
    def broad() -> None:
        try:
            raise signal
        except Exception:  # noqa: BLE001 - what the signal must get through
            pytest.fail("except Exception swallowed a cancellation signal")

    with pytest.raises(type(signal)):
        broad()
    with pytest.raises(errors.Cancelled):
        broad()
    assert not isinstance(signal, (errors.ResilientError, errors.StoreError, errors.TransportError))


def test_compatibility_bases():
    assert issubclass(errors.ResilientTimeout, TimeoutError) and issubclass(errors.ResilientTimeout, errors.ResilientError)
    assert issubclass(errors.RendezvousTimeout, errors.ResilientTimeout)
    assert issubclass(errors.ClosedError, errors.ConfigError)
    assert issubclass(errors.PeerUnreachable, errors.CollectiveError)
    assert issubclass(errors.OpMismatch, errors.TransportError) and issubclass(errors.TransportError, ConnectionError)


def test_the_example_in_docs_errors_md_runs():
    doc = (ROOT / "docs" / "errors.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert blocks, "docs/errors.md lost its example"
    for code in blocks:
        exec(compile(code, "docs/errors.md", "exec"), {})


def test_the_hierarchy_in_docs_and_the_module_docstring_lists_every_error():
    doc = (ROOT / "docs" / "errors.md").read_text()
    for name in errors.__all__:
        assert re.search(rf"\b{name}\b", doc), f"docs/errors.md does not list {name}"
        assert re.search(rf"\b{name}\b", errors.__doc__ or ""), f"resilient/errors.py's docstring lacks {name}"
