"""The joiner's state stream (resilient.elastic.stream) over real loopback sockets.

Asserted: the joiner receives exactly the state as it was when the source took its
snapshot (the admission step boundary), even though the source's live tensors go on
changing (training continues while the stream runs); a connection with a wrong token is
ignored; a cut stream is DataLost; no stream is a TimeoutError."""
from __future__ import annotations

import socket
import threading

import pytest
import torch

from resilient.elastic import ElasticSampler, State
from resilient.elastic.stream import MAGIC, _PREFIX, Snapshot, StateReceiver, serve
from resilient.errors import DataLost


def _training_state(seed: int, wide: int = 8192) -> State:
    torch.manual_seed(seed)
    # ~24 MiB of parameters + Adam state (wide=8192): more than the loopback socket buffers hold
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.Linear(256, wide),
                                torch.nn.Linear(wide, 8))
    opt = torch.optim.Adam(model.parameters())
    state = State(model=model, optimizer=opt, sampler=ElasticSampler(1000, 10, seed=3), step=0,
                  extra=torch.arange(5, dtype=torch.float16), name="run", joiner=False)
    return state


def _train_step(state: State) -> None:
    state.model(torch.randn(16, 64)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.sampler.record_step()
    state.step += 1


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], (list, tuple)):
            assert len(a[k]) == len(b[k])
            for x, y in zip(a[k], b[k]):
                _assert_same({"x": x}, {"x": y})
        else:
            assert a[k] == b[k], k


def test_joiner_gets_the_admission_snapshot_exactly_while_the_source_keeps_training():
    source, joiner = _training_state(1), _training_state(2)
    for _ in range(3):
        _train_step(source)
    source.model(torch.randn(16, 64))  # a forward pass moved the BatchNorm stats: buffers are copied
    at_admission = {k: v for k, v in source.state_dict().items()}
    expected = Snapshot(at_admission)  # an independent copy to compare against
    receiver = StateReceiver("127.0.0.1")
    got: dict = {}
    parts = source._snapshot_for_stream()  # noqa: SLF001 - what State.sync() serves: live params, no copy
    assert len(parts) == 2 and all(p.area is None and p.tensors for p in parts)
    serve(parts, "127.0.0.1", receiver.port, receiver.token)
    # the survivors' next steps overlap the stream: the source trains on while its send is
    # stuck on full socket buffers (the joiner reads only later); its optimizer.step() must
    # wait for the stream to end, or the joiner would get parameters from after admission
    trainer = threading.Thread(target=lambda: [_train_step(source) for _ in range(3)])
    trainer.start()

    def receive() -> None:  # what State.sync() does on the joiner
        first, rest = receiver.receive_first(30, into=joiner._param_targets)  # noqa: SLF001 - into the parameters
        got["first"] = first
        joiner._load_first_part(first, rest)  # noqa: SLF001 - the optimizer state goes on arriving

    t = threading.Thread(target=receive)
    t.start()
    trainer.join(30)
    assert not source.optimizer._optimizer_step_pre_hooks  # noqa: SLF001 - the one-shot hold is gone
    t.join(30)
    for p in parts:
        p.join(30)
    assert not parts[0].errors and "first" in got
    params = dict(joiner.model.named_parameters())
    assert all(got["first"]["model"][k].data_ptr() == p.data_ptr() for k, p in params.items())  # received in place
    assert "optimizer" not in got["first"]  # the optimizer state is the second part
    joiner._settle()  # noqa: SLF001 - what the joiner's first optimizer.step() does
    from resilient.torch_backend.codec import assemble

    _assert_same(joiner.state_dict(), assemble(expected.header, expected.area))
    assert joiner.step == 3 and joiner.sampler.processed == source.sampler.processed - 3 * 10
    assert not torch.equal(next(joiner.model.parameters()), next(source.model.parameters()))  # source moved on
    # and the joiner then trains bitwise like a survivor that was at the admission point
    twin = _training_state(5)
    twin.load_state_dict(assemble(expected.header, expected.area))
    torch.manual_seed(9)
    _train_step(joiner)
    torch.manual_seed(9)
    _train_step(twin)
    _assert_same(joiner.state_dict(), twin.state_dict())


def test_wrong_token_is_ignored_then_the_right_stream_is_received():
    receiver = StateReceiver("127.0.0.1")
    with socket.create_connection(("127.0.0.1", receiver.port)) as bad:
        bad.sendall(_PREFIX.pack(MAGIC, receiver.token ^ 1, 2, 0) + b"{}")
        snap = Snapshot({"w": torch.ones(3)})
        serve(snap, "127.0.0.1", receiver.port, receiver.token)
        obj = receiver.receive(30)
    assert torch.equal(obj["w"], torch.ones(3))


def test_cut_stream_is_data_lost_and_no_stream_is_a_timeout():
    receiver = StateReceiver("127.0.0.1")
    header = b'{"s":{"__t__":0},"t":[["float32",[1000],0,4000]]}'
    with socket.create_connection(("127.0.0.1", receiver.port)) as src:
        src.sendall(_PREFIX.pack(MAGIC, receiver.token, len(header), 4000) + header + b"\0" * 100)
        src.shutdown(socket.SHUT_WR)  # the source dies mid-stream
        with pytest.raises(DataLost, match="100 of 4000"):
            receiver.receive(30)
    with pytest.raises(TimeoutError, match="no state stream"):
        StateReceiver("127.0.0.1").receive(0.2)


def test_two_joiners_admitted_together_both_get_the_admission_state():
    """A whole node's joiners: one live snapshot, one stream each, the source's next
    optimizer step held until both streams are done."""
    from resilient.torch_backend.codec import assemble

    source, joiners = _training_state(1), [_training_state(2), _training_state(3)]
    _train_step(source)
    expected = Snapshot(source.state_dict())
    receivers = [StateReceiver("127.0.0.1") for _ in joiners]
    parts = source._snapshot_for_stream()  # noqa: SLF001
    for r in receivers:
        serve(parts, "127.0.0.1", r.port, r.token)
    trainer = threading.Thread(target=lambda: _train_step(source))
    trainer.start()
    got: list = [None, None]

    def receive(i: int) -> None:
        first, rest = receivers[i].receive_first(30, into=joiners[i]._param_targets)  # noqa: SLF001
        joiners[i]._load_first_part(first, rest)  # noqa: SLF001
        got[i] = True

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in [*threads, trainer]:
        t.join(30)
    assert not parts[0].errors and all(got)
    for j in joiners:
        _assert_same(j.state_dict(), assemble(expected.header, expected.area))  # state_dict() settles


def _serve_held(parts: list, port: int, token: int, release: threading.Event, cut: bool = False) -> threading.Thread:
    """The source's stream with its second part (the optimizer state) held back until
    ``release`` (or cut short after its prefix: the source died)."""
    def run() -> None:
        with socket.create_connection(("127.0.0.1", port)) as conn:
            first, second = parts
            conn.sendall(_PREFIX.pack(MAGIC, token, len(first.header), first.nbytes) + first.header)
            first.send_to(conn)
            release.wait(30)
            conn.sendall(_PREFIX.pack(MAGIC, token, len(second.header), second.nbytes) + second.header)
            if not cut:
                second.send_to(conn)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_joiner_trains_on_while_its_optimizer_state_arrives_and_steps_exactly_like_a_survivor():
    """The joiner's admission returns after the first part (model, fields): its forward and
    backward run while the optimizer state is still held back by the source; its first
    optimizer.step() waits for that part, and its state is then bitwise a survivor's."""
    from resilient.torch_backend.codec import assemble

    source, joiner, twin = _training_state(1, 1024), _training_state(2, 1024), _training_state(3, 1024)
    for _ in range(2):
        _train_step(source)
    expected = Snapshot(source.state_dict())
    twin.load_state_dict(assemble(expected.header, expected.area))
    parts = source._snapshot_for_stream()  # noqa: SLF001
    receiver, release = StateReceiver("127.0.0.1"), threading.Event()
    sender = _serve_held(parts, receiver.port, receiver.token, release)
    first, rest = receiver.receive_first(30, into=joiner._param_targets)  # noqa: SLF001
    joiner._load_first_part(first, rest)  # noqa: SLF001 - returns with the optimizer state not sent yet
    assert joiner.step == 2 and not joiner.optimizer.state  # fields here, optimizer state not yet
    assert all(torch.equal(a, b) for a, b in zip(joiner.model.parameters(), twin.model.parameters()))
    for s in (joiner, twin):
        torch.manual_seed(9)
        s.model(torch.randn(16, 64)).pow(2).mean().backward()  # the joiner's forward/backward: no wait
    assert not joiner.optimizer.state
    release.set()
    for s in (joiner, twin):
        s.optimizer.step()  # the joiner's waits for and loads the optimizer state first
        s.optimizer.zero_grad()
    sender.join(30)
    for p in parts:
        p.join(30)
    _assert_same(joiner.state_dict(), twin.state_dict())
    assert not joiner.optimizer._optimizer_step_pre_hooks  # noqa: SLF001 - the one-shot settle is gone


def test_optimizer_state_cut_short_is_data_lost_at_the_joiners_first_step():
    source, joiner = _training_state(1, 1024), _training_state(2, 1024)
    _train_step(source)
    parts = source._snapshot_for_stream()  # noqa: SLF001
    receiver, release = StateReceiver("127.0.0.1"), threading.Event()
    sender = _serve_held(parts, receiver.port, receiver.token, release, cut=True)
    first, rest = receiver.receive_first(30, into=joiner._param_targets)  # noqa: SLF001
    joiner._load_first_part(first, rest)  # noqa: SLF001
    release.set()
    sender.join(30)
    joiner.model(torch.randn(16, 64)).pow(2).mean().backward()
    with pytest.raises(DataLost, match="optimizer state did not arrive"):
        joiner.optimizer.step()
    with pytest.raises(DataLost):
        joiner.commit()  # and the state never pretends to be whole
    for p in parts:
        p.join(30)
