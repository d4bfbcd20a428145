"""Membership: which worker holds each cell; losses, spares and heals, by hand."""

from infra.cells.membership import Membership


def test_a_lost_cell_is_healed_by_the_next_spare_and_overdue_without_one():
    m = Membership(["a", "b", "c"], heal_timeout_s=10)
    assert m.observe({"a", "b", "c"}, 0.0).lost == ()
    # b dies; the nanny's restarted worker "b2" is not up yet
    obs = m.observe({"a", "c"}, 1.0)
    assert obs.lost == (1,) and obs.heal == () and obs.overdue == ()
    assert m.is_lost(1)
    # not reported twice; a spare appears and takes b's place at once
    obs = m.observe({"a", "c", "b2"}, 2.0)
    assert obs.lost == () and obs.heal == ((1, "b2"),)
    assert m.addrs == ["a", "b2", "c"] and m.is_lost(1)  # lost until its role is back
    assert m.observe({"a", "c", "b2"}, 3.0).heal == ()  # healing: not offered again
    m.healed(1)
    assert not m.is_lost(1)
    # a dead worker never comes back as a spare; c dies and no spare comes within the bound
    assert m.observe({"a", "b2", "b"}, 4.0).lost == (2,)
    assert m.observe({"a", "b2", "b"}, 10.0).overdue == ()
    assert m.observe({"a", "b2", "b"}, 14.5).overdue == ((2, 10.5),)


def test_two_losses_take_spares_in_order_and_a_failed_heal_waits_again():
    m = Membership(["a", "b"], heal_timeout_s=60)
    obs = m.observe({"x", "y"}, 0.0)
    assert obs.lost == (0, 1) and obs.heal == ((0, "x"), (1, "y"))
    m.heal_failed(0)  # x died while taking a's role
    m.healed(1)
    obs = m.observe({"y"}, 1.0)
    assert obs.lost == () and obs.heal == ()  # x is retired, no spare yet
    assert m.observe({"y", "z"}, 2.0).heal == ((0, "z"),)
