"""The progress bar's estimate (``cli.ui.Eta``) on a fake clock: the time left comes from the run's measured rate
of work units, so it neither swings with one scenario nor jumps by more than the work that finished."""
from gradcheck_cli.cli.ui import Eta


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_no_estimate_before_work_then_the_whole_run_s_rate():
    clock = Clock()
    eta = Eta(1000, clock)
    assert eta.remaining_s() is None and eta.describe() == "eta -:--:--"
    clock.now += 10
    eta.advance(100)  # 10 units a second so far
    assert eta.remaining_s() == 90.0 and eta.describe() == "eta 0:01:30" and eta.fraction == 0.1


def test_a_slow_scenario_moves_the_estimate_by_its_share_only():
    """Nine fast scenarios then one ten times slower per unit: the estimate after it is the run's average rate,
    not the slow scenario's (a recent-window estimate would multiply the time left by ten)."""
    clock = Clock()
    eta = Eta(2000, clock)
    for _ in range(9):
        clock.now += 1.0
        eta.advance(100)
    before = eta.remaining_s()
    clock.now += 10.0  # 100 units at a tenth of the speed
    eta.advance(100)
    after = eta.remaining_s()
    assert before == 9 / 900 * 1100 and after == 19 / 1000 * 1000
    assert after < 2 * before


def test_progress_never_jumps_by_more_than_the_work_that_finished_and_stops_at_the_total():
    clock = Clock()
    eta = Eta(300, clock)
    seen = [eta.fraction]
    for n in (5, 0, 120, 7, 500):
        clock.now += 1
        eta.advance(n)
        seen.append(eta.fraction)
    steps = [b - a for a, b in zip(seen, seen[1:])]
    assert all(s >= 0 for s in steps)
    assert [round(s * 300) for s in steps] == [5, 0, 120, 7, 168]  # the last capped at the total
    assert eta.fraction == 1.0 and eta.remaining_s() == 0.0
    eta.advance(-3)  # a negative count is ignored
    assert eta.done == 300


def test_an_empty_run_is_complete():
    assert Eta(0, Clock()).fraction == 1.0
