"""A group's sub-task count: the configured count when nothing scales it, however large."""

from tasks.sched.config import PacingConfig, group_shape


def test_unscaled_groups_keep_every_subtask_of_a_long_horizon_suite() -> None:
    # the long preset's 200 sub-tasks: a fixed cap of 32 once cut every rollout to 32 calls
    pacing = PacingConfig()
    for index in range(5):
        n, _, _ = group_shape(pacing, 200, index, 5, seed=1)
        assert n == 200


def test_scaled_groups_stay_within_four_times_the_setting_and_never_below_one() -> None:
    pacing = PacingConfig(length_sigma=3.0, length_growth=16.0)
    small = [group_shape(pacing, 2, i, 50, seed=3)[0] for i in range(50)]
    assert min(small) >= 1 and max(small) <= 32  # short suites: the old cap of 32
    large = [group_shape(pacing, 100, i, 50, seed=3)[0] for i in range(50)]
    assert max(large) <= 400 and max(large) > 32
