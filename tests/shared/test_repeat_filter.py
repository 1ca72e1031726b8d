"""RepeatFilter: a report goes out when it changed or its keepalive is due, never a repeat
in between; the send time alone is no news."""

from shared.repeat_filter import RepeatFilter
from shared.schemas.telemetry import ClassLoad, Telemetry


def _report(sent_at: float, running: int = 0) -> Telemetry:
    return Telemetry(worker_id="w", sent_at=sent_at, rt=ClassLoad(running=running))


def test_repeats_wait_for_the_keepalive_and_changes_go_at_once():
    f = RepeatFilter(keepalive_s=10.0)
    assert f.worth_sending(_report(1.0), now=0.0)  # the first report always goes
    f.sent(_report(1.0), now=0.0)
    assert not f.worth_sending(_report(2.0), now=1.0)  # only the send time differs
    assert not f.worth_sending(_report(9.0), now=9.9)
    assert f.worth_sending(_report(3.0, running=1), now=2.0)  # news: at once
    assert f.worth_sending(_report(10.0), now=10.0)  # keepalive due
    f.sent(_report(10.0), now=10.0)
    assert not f.worth_sending(_report(11.0), now=11.0)
