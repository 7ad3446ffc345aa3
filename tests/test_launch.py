"""``ckptaudit.launch``: a rank that dies by a signal or hangs explains itself in the error.

Real ranks (gloo), real deaths: glibc's own abort on a bad ``free``, a segmentation fault, a sleep past the
deadline. The message must carry what the dying rank wrote to its standard error (glibc's line, faulthandler's
stack naming the function), name the rank that ended first, and the parent must still see the ranks' output.
"""

from __future__ import annotations

from typing import Any

import pytest

import launch_jobs
from ckptaudit.launch import DistributedError, launch

pytestmark = pytest.mark.dist

FAST: dict[str, Any] = {"start_method": "forkserver", "preload": ("torch", "launch_jobs")}


def test_what_ranks_write_to_stderr_reaches_the_parent_tagged_by_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert launch(launch_jobs.say, 2, ("hello",), timeout_s=120, **FAST) == [0, 1]
    err = capsys.readouterr().err
    assert "[rank 0] hello from rank 0\n" in err
    assert "[rank 1] hello from rank 1\n" in err  # the unfinished last line too


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_rank_glibc_aborts_names_itself_first_with_glibcs_message(start_method: str) -> None:
    opts = FAST if start_method == "forkserver" else {"start_method": "spawn"}
    with pytest.raises(DistributedError) as err:
        launch(launch_jobs.bad_free_on_rank_1, 2, timeout_s=120, pg_timeout_s=60, **opts)
    failures = {f.rank: f for f in err.value.failures}
    dead = failures[1]
    assert dead.reason == "exit" and "-6" in dead.detail and "SIGABRT" in dead.detail
    assert dead.first and not failures.get(0, dead).first
    # What the rank said, glibc's reason, and faulthandler's stack down to the user's function.
    assert "rank 1 is about to free a pointer malloc never returned" in dead.stderr
    assert "free(): invalid pointer" in dead.stderr
    assert "Fatal Python error: Aborted" in dead.stderr and "bad_free_on_rank_1" in dead.stderr
    message = str(err.value)
    assert message.splitlines()[0].endswith("(rank 1 first):") or len(failures) == 1, message
    assert message.splitlines()[1].startswith("  rank 1: exit: process ended with exit code -6 (killed by SIGABRT)")
    assert "| free(): invalid pointer" in message and "bad_free_on_rank_1" in message


def test_a_segfault_reports_the_function_it_happened_in() -> None:
    with pytest.raises(DistributedError) as err:
        launch(launch_jobs.segfault_on_rank_0, 2, timeout_s=120, pg_timeout_s=60, **FAST)
    dead = next(f for f in err.value.failures if f.rank == 0)
    assert dead.first and "SIGSEGV" in dead.detail
    assert "Fatal Python error: Segmentation fault" in dead.stderr
    assert "_read_address_zero" in dead.stderr and "segfault_on_rank_0" in dead.stderr
    assert "_read_address_zero" in str(err.value)


def test_a_hung_rank_is_killed_with_the_stack_it_hung_in() -> None:
    # The deadline must let both ranks start (rank 0 returns at once): 5x what a launch that returns at once took
    # just now, from the same fork server (it also starts the server), between 10 s and the 30 s a cold start on
    # 2 loaded cores was given: the test waits 10 s on a warm server, not 30.
    import time

    start = time.monotonic()
    assert launch(launch_jobs.say, 2, ("warm",), timeout_s=120, **FAST) == [0, 1]
    deadline = min(30.0, max(10.0, 5 * (time.monotonic() - start)))
    with pytest.raises(DistributedError) as err:
        launch(launch_jobs.hang_on_rank_1, 2, (600.0,), timeout_s=deadline, **FAST)
    (hung,) = err.value.failures
    assert hung.rank == 1 and hung.reason == "timeout"
    assert "_stuck_here" in hung.stderr and "hang_on_rank_1" in hung.stderr
    assert err.value.results == {0: None}
