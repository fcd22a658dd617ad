"""train/stragglers.py's rule: the rank the others wait for, by their shares of waiting."""

import pytest

from pipeline.train.stragglers import SLOWDOWN, Straggler, find_straggler


def test_the_rank_the_others_wait_for_is_named_with_its_slowdown():
    # ranks 0, 1, 3 wait 5 of their 15 s of steps for rank 2, which waits 1.5 s (it is
    # slowed inside the all-reduce too)
    found = find_straggler([5.0, 5.0, 1.5, 5.0], [15.0, 15.0, 15.0, 15.0])
    assert found is not None
    rank, slowdown, waited = found
    assert rank == 2 and waited == pytest.approx(1 / 3)
    assert slowdown == pytest.approx(0.9 / (2 / 3))


def test_ranks_that_wait_alike_are_not_named():
    limit = 1 - 1 / SLOWDOWN
    assert find_straggler([2.0, 2.0, 2.0 - 10 * limit * 0.99], [10.0, 10.0, 10.0]) is None
    assert find_straggler([1.0, 0.5], [10.0, 10.0]) is None  # 5% apart: noise
    assert find_straggler([5.0], [5.0]) is None  # one rank: nobody to be slower than
    assert find_straggler([0.0, 0.0], [0.0, 0.0]) is None


def test_two_ranks_and_the_line():
    found = find_straggler([0.0, 2.0], [4.0, 4.0])
    assert found == (0, pytest.approx(2.0), pytest.approx(0.5))
    line = Straggler(0, "node0", "198.18.0.11", 2.0, 0.5, 101, 200).line()
    assert line.startswith("plm: rank 0 on node0 (198.18.0.11) is a straggler:")
    assert "steps 101-200" in line and "2.00x" in line and "50%" in line
