"""Transport selection for CUDA tensors (resilient.device.select): pure logic, no GPU."""
from __future__ import annotations

import pytest
import torch

from resilient.device.select import UUID_LABEL, DeviceRecord, choose_transport
from resilient.errors import ConfigError, RecordError

U = ["GPU-11111111-aaaa", "GPU-22222222-bbbb", "GPU-33333333-cccc", "GPU-44444444-dddd"]


def gpu(member: str, uuid: str | None, host: str = "node0", nccl: bool = True) -> DeviceRecord:
    return DeviceRecord(member, host, "cuda:0", uuid, nccl)


def test_every_member_with_its_own_gpu_gets_nccl():
    recs = [gpu(f"m{i}", U[i], host=f"node{i // 2}") for i in range(4)]
    choice = choose_transport(recs)
    assert choice.kind == "nccl"
    assert "4 distinct UUIDs on 2 host(s)" in choice.reason


def test_ranks_sharing_one_gpu_are_host_staged_and_named():
    recs = [gpu("m0", U[0]), gpu("m1", U[1]), gpu("m2", U[1]), gpu("m3", U[2])]
    choice = choose_transport(recs)
    assert choice.kind == "host-staged"
    assert U[1] in choice.reason and "m1@node0" in choice.reason and "m2@node0" in choice.reason
    assert "m0" not in choice.reason


def test_four_ranks_on_one_gpu_are_host_staged():
    assert choose_transport([gpu(f"m{i}", U[0]) for i in range(4)]).kind == "host-staged"


def test_all_cpu_members_keep_the_tcp_path():
    recs = [DeviceRecord(f"m{i}", "node0", "cpu") for i in range(3)]
    assert choose_transport(recs).kind == "tcp"


@pytest.mark.parametrize("recs, words", [
    ([gpu("m0", U[0]), DeviceRecord("m1", "node0", "cpu")], "m1 have CPU tensors"),
    ([gpu("m0", U[0]), gpu("m1", None)], "m1 did not report"),
    ([gpu("m0", U[0]), gpu("m1", U[1], nccl=False)], "m1 cannot load NCCL"),
    ([gpu("m0", U[0])], "single member"),
])
def test_each_reason_nccl_is_out_is_reported(recs, words):
    choice = choose_transport(recs)
    assert choice.kind == "host-staged" and words in choice.reason


def test_preferences_force_staging_or_demand_nccl():
    own = [gpu("m0", U[0]), gpu("m1", U[1])]
    assert choose_transport(own, prefer="host-staged").kind == "host-staged"
    assert choose_transport(own, prefer="nccl").kind == "nccl"
    with pytest.raises(ConfigError, match="share GPU"):
        choose_transport([gpu("m0", U[0]), gpu("m1", U[0])], prefer="nccl")
    with pytest.raises(ConfigError, match="unknown transport preference"):
        choose_transport(own, prefer="fastest")  # type: ignore[arg-type]


def test_empty_or_duplicated_member_lists_are_refused():
    with pytest.raises(ConfigError, match="got none"):
        choose_transport([])
    with pytest.raises(ConfigError, match="m0 have more than one"):
        choose_transport([gpu("m0", U[0]), gpu("m0", U[1])])


def test_record_from_member_fields_reads_the_uuid_label():
    rec = DeviceRecord.from_member("m3", "node1", "cuda:1", {UUID_LABEL: U[3], "rack": "r1"}, nccl=True)
    assert rec.gpu_uuid == U[3] and rec.on_cuda


def test_json_round_trip_and_validation():
    rec = gpu("m0", U[0])
    assert DeviceRecord.from_json(rec.to_json()) == rec


@pytest.mark.parametrize("raw, match", [
    (b"\xff", "not UTF-8 JSON"),
    (b"[1]", "must be an object"),
    (b'{"member":"m0","host":"h","device":"cuda","gpu_uuid":null}', "must be an object"),
    (b'{"member":"m0","host":"h","device":"tpu","gpu_uuid":null,"nccl":false}', "neither 'cpu'"),
    (b'{"member":"m0","host":"h","device":"cuda","gpu_uuid":"not a uuid!","nccl":false}', "not a GPU UUID"),
    (b'{"member":"m0","host":"h","device":"cpu","gpu_uuid":"GPU-11111111","nccl":false}', "only for CUDA"),
    (b'{"member":"m0","host":"h","device":"cuda","gpu_uuid":null,"nccl":1}', "true or false"),
    (b'{"member":"","host":"h","device":"cuda","gpu_uuid":null,"nccl":true}', "member"),
    (b'{"member":"m0","host":7,"device":"cuda","gpu_uuid":null,"nccl":true}', "host"),
])
def test_malformed_records_raise_record_error_naming_the_field(raw, match):
    with pytest.raises(RecordError, match=match):
        DeviceRecord.from_json(raw)


def test_local_record_of_a_cpu_member_has_no_uuid():
    from resilient.device.probe import local_record

    rec = local_record("m0", "node0", "cpu")
    assert rec == DeviceRecord("m0", "node0", "cpu", None, False)


def test_local_record_of_a_cuda_member_without_cuda_names_the_fix():
    import torch

    from resilient.device.probe import local_record

    if torch.cuda.is_available():
        rec = local_record("m0", "node0", "cuda:0")
        assert rec.gpu_uuid is not None and rec.gpu_uuid.startswith("GPU-")
        return
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[gpu\]'"):
        local_record("m0", "node0", "cuda:0")
    with pytest.raises(ConfigError, match="not supported"):
        local_record("m0", "node0", "meta")


def test_member_record_takes_a_given_record_only_for_its_own_member_and_cpu_has_no_labels():
    from resilient.device.probe import member_record, this_device

    claimed = DeviceRecord("m1", "node0", "cuda:0", U[1], True)
    assert member_record("m1", "node0", claimed) is claimed
    assert claimed.labels() == {UUID_LABEL: U[1], "resilient.nccl": "1"}
    with pytest.raises(ConfigError, match="device record of 'm1' given to member 'm2'"):
        member_record("m2", "node0", claimed)
    cpu = member_record("m0", "node0", "cpu")
    assert cpu == DeviceRecord("m0", "node0", "cpu") and cpu.labels() == {}
    if not torch.cuda.is_available():
        assert this_device() == "cpu"


@pytest.mark.parametrize("current,count,local,expected", [
    (0, 4, "2", "cuda:2"),      # set_device(local_rank) comes after init: LOCAL_RANK names the GPU
    (0, 4, "6", "cuda:2"),      # more local ranks than GPUs: shared round-robin
    (3, 4, "1", "cuda:3"),      # the script already chose a device: that one
    (0, 1, "3", "cuda:0"),      # one GPU: every rank on it
    (0, 4, "", "cuda:0"),       # no launcher rank: the current device
])
def test_this_device_follows_the_current_device_or_the_launchers_local_rank(monkeypatch, current, count, local,
                                                                           expected):
    from resilient.device import probe

    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(probe.torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(probe.torch.cuda, "device_count", lambda: count)
    monkeypatch.setenv("LOCAL_RANK", local)
    assert probe.this_device() == expected
