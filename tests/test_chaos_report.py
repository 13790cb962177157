"""Reports: the JSON summary has the promised keys and counts; the PNG timeline is a valid
PNG of the documented size; the table shows PASS/FAIL and the findings."""
from __future__ import annotations

import json
import struct
import textwrap


from resilient.chaos.report import SUMMARY_KEYS, render_table, summarize, timeline_size, write_reports
from resilient.chaos.scenario import parse_scenario
from resilient.chaos.verifier import EpochEvent, FaultEvent, OpRecord, RunLog, verify
from resilient.chaos.workload import expected_output, op_spec_for

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run(seed: int, corrupt: bool = False) -> RunLog:
    sc = parse_scenario(textwrap.dedent("""\
        name: report-unit
        world_size: 4
        workload:
          ops: 6
          mix: [{collective: allreduce, op: sum, dtype: int64, numel: 32}]
        faults:
          - {kind: kill, member: 3, at: {op: 2, phase: rs, progress: 0.5}}
        """), "r.yaml")
    records = []
    for seq in range(6):
        members = (0, 1, 2, 3) if seq < 2 else (0, 1, 2)
        spec = op_spec_for(seq, seed, sc.workload.mix)
        out = expected_output(spec, seq, seed, members).value.copy()
        for m in members:
            o = out.copy()
            if corrupt and seq == 4 and m == 1:
                o[0] += 1
            end = seq * 0.5 + (0.8 if seq == 2 else 0.3)
            records.append(OpRecord(m, seq, seq * 0.5, end, members, o, epoch=1 if seq < 2 else 2))
    records.append(OpRecord(3, 2, 1.0, None))  # the victim never finished op 2
    return RunLog(sc, seed, records, faults=[FaultEvent("kill", 1.2, "member 3", victim=3)],
                  epochs=[EpochEvent(1, 0.0, (0, 1, 2, 3)), EpochEvent(2, 1.4, (0, 1, 2))], duration_s=3.0)


def test_summary_json_keys_and_counts():
    runs = [_run(0), _run(1, corrupt=True)]
    verdicts = [verify(r) for r in runs]
    s = summarize(verdicts)
    assert list(s)[:6] == list(SUMMARY_KEYS)
    assert set(SUMMARY_KEYS) == {"ops", "faults", "wrong", "hangs", "recovery_p50_s", "recovery_p99_s"}
    assert s["ops"] == 12 and s["faults"] == 2 and s["wrong"] == 1 and s["hangs"] == 0 and s["lost"] == 0
    assert s["passed"] is False and s["seeds"] == [0, 1]
    # recovery: fault at 1.2 s; op 2 ends at 1.8 s on every survivor
    assert abs(s["recovery_p50_s"] - 0.6) < 1e-9 and abs(s["recovery_p99_s"] - 0.6) < 1e-9
    json.dumps(s)  # serialisable as is
    assert summarize([verify(_run(0))])["passed"] is True


def test_summary_without_recoveries_reports_null():
    run = _run(0)
    run.faults = []
    s = summarize([verify(run)])
    assert s["recovery_p50_s"] is None and s["recovery_p99_s"] is None


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_SIGNATURE
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_report_dir_has_json_table_and_a_valid_png_of_the_expected_size(tmp_path):
    runs = [_run(0), _run(1, corrupt=True)]
    verdicts = [verify(r) for r in runs]
    written = write_reports(runs, verdicts, tmp_path / "rep")
    names = sorted(p.name for p in written)
    assert names == ["summary.json", "table.txt", "timeline-seed0.png", "timeline-seed1.png"]
    assert json.loads((tmp_path / "rep" / "summary.json").read_text())["wrong"] == 1
    for seed in (0, 1):
        data = (tmp_path / "rep" / f"timeline-seed{seed}.png").read_bytes()
        assert _png_size(data) == timeline_size(4)
        assert data.endswith(b"IEND\xaeB`\x82")
        assert len(data) > 5000  # drawn, not blank


def test_table_shows_verdict_and_findings():
    verdicts = [verify(_run(0)), verify(_run(1, corrupt=True))]
    table = render_table(verdicts)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["scenario", "seed", "ops"]
    assert "PASS" in lines[2] and "FAIL" in lines[3] and lines[4].startswith("total")
    assert "seed 1 WRONG: op 4 (member 1)" in table
