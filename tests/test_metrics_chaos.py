"""Metrics under chaos (issue 8): during a real chaos run with K injected kills, scrape the
real /metrics endpoints and check them against what happened.

The chaos runner (`metrics=True`) acts as the node agent of each member — one
prometheus-client multiprocess `/metrics` per member, as if each member ran on its own
node — and starts the coordinators with `--metrics-port 0`. The run is the real thing:
etcd, coordinator processes, member processes driving the Communicator over TCP, and two
SIGKILLs fired inside ops (reduce-scatter of op 3, all-gather of op 6). Scrapes happen
before the workload starts and after every op finished, while every process is still up.

Asserted: the leader coordinator's `resilient_epoch` and every survivor's
`resilient_rank_epoch` equal the epoch number in etcd (the Communicator sets the gauge on
every epoch it enters); every survivor's `resilient_ops_resumed_total` rose by exactly the
number of ops it finished through a recovery, and both kills were recovered from; issue 8:
`resilient_recoveries_total` (one per adopted epoch that removed members, summed over
causes) rose by exactly K on every survivor, whether or not its op was in flight."""
from __future__ import annotations

import textwrap
import urllib.request

import pytest

from resilient.chaos.runner import ChaosRunner
from resilient.chaos.scenario import parse_scenario
from resilient.chaos.verifier import verify

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

K = 2


def scrape(url: str) -> dict[str, float]:
    """``metric{labels}`` -> value, from the Prometheus text format (comments skipped)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "pid")
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{", 1)[0] == name)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real chaos run with K = 2 kills; scrapes before and after (shared by the tests)."""
    tmp_path = tmp_path_factory.mktemp("metrics-chaos")
    path = tmp_path / "two-kills.yaml"
    path.write_text(textwrap.dedent("""\
        name: metrics-two-kills
        world_size: 5
        workload:
          ops: 9
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 65536}]
        faults:
          - {kind: kill, member: 1, at: {op: 3, phase: reduce_scatter, progress: 0.5}}
          - {kind: kill, member: 3, at: {op: 6, phase: all_gather, progress: 0.5}}
        """))
    sc = parse_scenario(path.read_text(), str(path))
    before: dict[int, dict[str, float]] = {}
    after: dict[str, object] = {}

    def on_finished(runner: ChaosRunner) -> None:
        from resilient.coordinator.election import current_leader
        from resilient.coordinator.epoch import read_epoch

        after["members"] = {i: scrape(url) for i, url in runner.metrics_urls.items() if runner.workers[i].alive()}
        after["etcd_epoch"] = read_epoch(runner.store, runner.job)[0].number
        after["coordinator"] = scrape(runner.coordinator_metrics_url(current_leader(runner.store, runner.job)))

    # the ring between these same-host members (the members inherit the environment): the
    # kills must be recovered from, where the direct shared-memory allreduce may finish
    # over the full set without a recovery (tests/conftest.py ring_on_one_host)
    mp = pytest.MonkeyPatch()
    mp.setenv("RESILIENT_SHM_DIRECT", "0")

    def baseline(r: ChaosRunner) -> None:  # every member up, before the workload starts (the `go` file)
        for i, url in list(r.metrics_urls.items()):
            before[i] = scrape(url)

    try:
        runner = ChaosRunner(sc, 0, tmp_path / "wd", backend="resilient", metrics=True, on_finished=on_finished,
                             on_ready=baseline)
        log = runner.run()
    finally:
        mp.undo()
    procs = list(runner.workers.values()) + list(runner.coordinators.values())
    assert all(p.popen.poll() is not None for p in procs), "the runner left a process behind"
    v = verify(log)
    assert v.passed and v.faults == K, (v.wrong, v.hangs, v.lost, v.skipped)
    assert set(before) == set(range(5)) and set(after["members"]) == SURVIVORS
    return log, before, after


SURVIVORS = {0, 2, 4}


def _rose(run, i: int, name: str = "resilient_recoveries_total") -> float:
    _, before, after = run
    return total(after["members"][i], name) - total(before[i], name)


def test_coordinator_epoch_gauge_matches_etcd(run):
    _, _, after = run
    epoch = after["etcd_epoch"]
    assert epoch >= 1 + K  # the first epoch, then one per kill
    assert total(after["coordinator"], "resilient_epoch") == epoch
    assert total(after["coordinator"], "resilient_coordinator_is_leader") == 1


def test_rank_epoch_gauges_match_etcd(run):
    _, _, after = run
    for i in SURVIVORS:
        assert total(after["members"][i], "resilient_rank_epoch") == after["etcd_epoch"], f"member {i}"


def test_ops_resumed_metric_counts_every_recovered_op(run):
    """Each survivor's resilient_ops_resumed_total rose by exactly the ops it finished
    through a recovery (as its own records say), and over all survivors every kill shows up."""
    log, _, _ = run
    for i in SURVIVORS:
        recovered = [r.seq for r in log.records if r.member == i and r.recovered]
        assert _rose(run, i, "resilient_ops_resumed_total") == len(recovered), f"member {i}: recovered ops {recovered}"
    recovered_ops = {r.seq for r in log.records if r.recovered and r.member in SURVIVORS}
    assert recovered_ops == {3, 6}  # both kills were recovered from


def test_recoveries_total_rose_by_exactly_k_on_every_survivor(run):
    for i in SURVIVORS:
        assert _rose(run, i) == K, f"member {i}: resilient_recoveries_total rose by {_rose(run, i)}, expected {K}"
