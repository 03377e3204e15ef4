"""The soak bench's RSS slope: least squares per hour, None where it cannot be known."""

from services.bench.soak import slope_per_hour


def test_a_steady_rise_is_its_rate_per_hour_and_noise_around_a_flat_line_is_near_zero():
    assert slope_per_hour([(0, 100.0), (1800, 105.0), (3600, 110.0)]) == 10.0
    assert abs(slope_per_hour([(0, 100.0), (60, 101.0), (120, 99.0), (180, 100.0)])) < 30
    assert slope_per_hour([(0, 100.0)]) is None and slope_per_hour([(5, 1.0), (5, 2.0)]) is None
