"""`tandem chaos` checked on a short run: a real stack (tansu, scheduler, advisory, queue, two
workers, two gateways), one cheap fault (the advisory service SIGKILLed and restarted) under RT
streams and a batch job. The harness must count every request and item, judge every answer
against its reference, and time the recovery; plus the judging rules alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from loadgen.chaos.clients import RTRecord
from loadgen.chaos.run import ChaosConfig, FaultRecord, _summary, targets

pytestmark = pytest.mark.timeout(900)


def test_a_short_chaos_run_counts_everything(tmp_path, tiny_model_dir):
    out = tmp_path / "chaos.json"
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "chaos", "--model", str(tiny_model_dir("llama")), "--faults", "advisory"]
        + ["--repeats", "1", "--batch-items", "6", "--log-dir", str(tmp_path / "logs"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["provenance"]["git"]["commit"]
    fault = result["faults"]["advisory"]
    assert fault["repeats"] == 1 and fault["recovered"] == 1 and fault["recovery_s"][0] > 0
    served = result["rounds"][0]["probes"][-1]  # the probe request that ended the recovery, by its id
    assert served["error"] is None and served["request_id"].startswith("probe-advisory-r0-")
    assert result["baseline_probe_s"] > 0
    rt = result["rt"]
    assert rt["requests"] > 0 and rt["lost"] == 0 and rt["gaps_or_repeats"] == 0
    assert rt["ok"] == rt["requests"]
    batch = result["batch"]
    assert (batch["jobs"], batch["items"]) == (1, 6)
    assert (batch["ok"], batch["lost"], batch["duplicated"], batch["failed"]) == (6, 0, 0, 0)
    assert result["crashed"] == []


def test_a_short_ha_chaos_run_kills_the_active_scheduler(tmp_path, tiny_model_dir):
    """`--ha`: the scheduler, advisory and queue run as pairs; the fault kills the active
    scheduler, the standby takes over (a higher term in its log), the harness starts the killed
    one again and it stands by; nothing is lost."""
    out, logs = tmp_path / "chaos.json", tmp_path / "logs"
    res = subprocess.run(
        [sys.executable, "-m", "services.cli", "chaos", "--model", str(tiny_model_dir("llama")), "--ha"]
        + ["--faults", "scheduler", "--repeats", "1", "--batch-items", "6", "--log-dir", str(logs), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    result = json.loads(out.read_text())
    [killed] = result["rounds"][0]["killed"]
    other = {"scheduler-a": "scheduler-b", "scheduler-b": "scheduler-a"}[killed]
    killed_log, other_log = (logs / f"{killed}.log").read_text(), (logs / f"{other}.log").read_text()
    assert "scheduler active (term 1)" in killed_log and "scheduler active (term 2)" in other_log
    assert killed_log.count("scheduler standing by") >= 1  # started again after the kill: the standby
    assert result["faults"]["scheduler"]["recovered"] == 1
    assert result["rt"]["lost"] == 0 and result["rt"]["gaps_or_repeats"] == 0
    batch = result["batch"]
    assert (batch["ok"], batch["lost"], batch["duplicated"], batch["failed"]) == (6, 0, 0, 0)
    assert result["crashed"] == []


def test_judging_counts_losses_mismatches_and_retries():
    records = [
        RTRecord(prompt=0, started=1.0, finished=2.0, attempts=1, outcome="ok"),
        RTRecord(
            prompt=1, started=1.0, finished=3.0, attempts=3, outcome="mismatch", errors=["u: ConnectError: x"] * 2
        ),
        RTRecord(prompt=2, started=1.0, finished=9.0, attempts=5, outcome="lost"),
        RTRecord(prompt=3, started=1.0),  # still running when the clients stopped
    ]
    kill = FaultRecord("worker", 0, killed_at=5.0, killed=["worker-0"], recovery_s=None, ready_again_s=None, crashed=[])
    s = _summary(ChaosConfig(faults=("worker",), repeats=1), [kill], records, [])
    rt = s["rt"]
    assert (rt["requests"], rt["ok"], rt["gaps_or_repeats"], rt["lost"]) == (3, 1, 1, 1)
    assert (rt["retried"], rt["attempts"], rt["unfinished_at_stop"]) == (2, 9, 1)
    assert rt["error_kinds"] == {"ConnectError: x": 2}
    assert s["faults"]["worker"]["recovery_p50_s"] is None
    # each request not answered right, with the faults whose kill fell while it was tried
    assert [(r["prompt"], r["outcome"], r["faults"]) for r in s["rt_lost"]] == [
        (1, "mismatch", []),
        (2, "lost", ["worker#0"]),
    ]


def test_a_loss_sent_just_after_a_kill_names_the_round_it_fell_in():
    """The eighth session's busy run lost three requests sent 3.5 s after an advisory+scheduler
    kill whose stack was never ready again: `faults` (kills while it was tried) was empty, so the
    record names the round in effect when it started too."""
    rounds = [
        FaultRecord(
            "advisory+scheduler", 0, killed_at=100.0, killed=[], recovery_s=None, ready_again_s=None, crashed=[]
        ),
        FaultRecord("queue", 0, killed_at=400.0, killed=[], recovery_s=2.0, ready_again_s=4.0, crashed=[]),
    ]
    records = [
        RTRecord(prompt=0, started=103.5, finished=236.0, attempts=5, outcome="lost"),  # never ready again
        RTRecord(prompt=1, started=402.0, finished=530.0, attempts=2, outcome="lost"),  # before ready again
        RTRecord(prompt=2, started=410.0, finished=540.0, attempts=2, outcome="lost"),  # after: no round
    ]
    s = _summary(ChaosConfig(faults=("advisory+scheduler", "queue"), repeats=1), rounds, records, [])
    assert [(r["faults"], r["in_round"]) for r in s["rt_lost"]] == [
        ([], "advisory+scheduler#0"),
        ([], "queue#0"),
        ([], None),
    ]


def test_fault_names_are_checked():
    assert targets("broker+scheduler") == ["broker", "scheduler"]
    with pytest.raises(ValueError, match="unknown fault kind 'disk'"):
        targets("disk")
