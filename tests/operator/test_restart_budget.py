"""How often the operator runs kopf's reactor again after a watch was answered 404 (__main__.run_reactor): at
most 5 times within any 10 minutes, then it stops, so a 404 that keeps coming ends in an exit code, not in a
loop nobody sees."""

from spyre_operator.__main__ import RestartBudget


def test_five_restarts_in_ten_minutes_then_none_until_the_oldest_is_ten_minutes_old():
    budget = RestartBudget()
    assert [budget.spend(t) for t in (0, 1, 2, 3, 4)] == [True] * 5
    assert budget.spend(5) is False  # a sixth within the window
    fresh = RestartBudget()
    assert all(fresh.spend(t) for t in (0, 100, 200, 300, 400))
    assert fresh.spend(601) is True  # the restart at 0 left the window
    assert fresh.spend(602) is False  # 100..602: six within 600 s
