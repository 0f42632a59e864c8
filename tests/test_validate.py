"""staleopt.validate.check_int: one wording for every integer argument."""
import numpy as np
import pytest

from staleopt.errors import ConfigError, CorrectionError, ScheduleError
from staleopt.validate import check_int


def test_accepts_ints_in_range_and_returns_them():
    assert check_int("stages", 3, minimum=1) == 3
    assert check_int("seed", 0, minimum=0) == 0
    assert check_int("segment", 4, minimum=1, maximum=4) == 4
    assert check_int("offset", -7) == -7
    assert check_int("max_steps", None, minimum=1, optional=True) is None
    got = check_int("tau", np.int64(5), minimum=0)       # NumPy integers too, returned as int
    assert got == 5 and type(got) is int


@pytest.mark.parametrize("value", [0, -1, True, False, np.bool_(True), 1.0, np.float64(2.0), 2.5, "3", None, [1]])
def test_rejects_non_ints_bools_and_values_below_the_minimum(value):
    with pytest.raises(ConfigError, match=r"^stages = .* must be an int >= 1$"):
        check_int("stages", value, minimum=1)


def test_message_names_value_range_and_reason():
    with pytest.raises(ConfigError) as e:
        check_int("microbatches", 0, minimum=1, why="microbatches per minibatch")
    assert str(e.value) == "microbatches = 0 must be an int >= 1 (microbatches per minibatch)"
    with pytest.raises(ConfigError) as e:
        check_int("segment", 5, minimum=1, maximum=4)
    assert str(e.value) == "segment = 5 must be an int in 1..4"
    with pytest.raises(ConfigError) as e:
        check_int("depth", 9, maximum=8)
    assert str(e.value) == "depth = 9 must be an int <= 8"
    with pytest.raises(ConfigError) as e:
        check_int("warmup_steps", -1, minimum=0, optional=True)
    assert str(e.value) == "warmup_steps = -1 must be an int >= 0 or None"
    with pytest.raises(ConfigError) as e:
        check_int("count", "x")
    assert str(e.value) == "count = 'x' must be an int"


def test_raises_the_error_type_asked_for():
    with pytest.raises(ScheduleError, match="tau_max = -1 must be an int >= 0"):
        check_int("tau_max", -1, minimum=0, error=ScheduleError)
    with pytest.raises(CorrectionError, match="steps = -2 must be an int >= 0"):
        check_int("steps", -2, minimum=0, error=CorrectionError)
