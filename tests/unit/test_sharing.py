"""Training that shares the machine (frugaltune.training.sharing): a thread less while other processes crowd the
cores, the plan's threads back once a core stays idle, and the plan's threads after the run.

Run with `pytest tests/unit/test_sharing.py` (seconds). The decisions are driven by the windows' figures below (as
/proc/stat would give them); the last test reads this machine's own.
"""

from __future__ import annotations

import time

import pytest
import torch

from frugaltune.training import sharing
from frugaltune.training.sharing import CoreShare


class Windows(CoreShare):
    """A CoreShare fed (seconds, this process's CPU, the cores' busy, idle[, steal]) per window instead of
    /proc/stat."""

    def __init__(self, windows: list[tuple[float, ...]], events: list[str]) -> None:
        self.windows = iter(windows)
        self.total = [0.0] * 5
        super().__init__(events.append)

    def _sample(self):
        step = (*next(self.windows, (0.0,) * 5), 0.0)[:5]
        self.total = [a + b for a, b in zip(self.total, step)]
        return tuple(self.total)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_crowded_run_gives_a_thread_up_and_takes_it_back_when_a_core_is_idle(two_threads):
    events: list[str] = []
    windows = [(0, 0, 0, 0),  # the first sample
               (6, 12, 12, 0),  # alone: its two threads get a core each
               (6, 6, 12, 0),  # another process takes a core: 50 % a thread, the other 1.0 core busy
               (6, 6, 12, 0),  # on one thread, sharing: nothing idle, it stays
               (6, 6, 6, 6)]  # the other is gone: a core idle
    with Windows(windows, events) as share:
        threads = []
        for _ in range(len(windows) - 1):
            share.after_step()
            threads.append(torch.get_num_threads())
    assert threads == [2, 1, 1, 2]
    assert events[0].startswith("threads 2 -> 1: other processes use 1.0 of the cores") and "50%" in events[0]
    assert events[1] == "threads 1 -> 2: 1.0 cores idle"


def test_time_the_hypervisor_took_crowds_the_threads_as_a_process_would_and_the_event_says_whose(two_threads):
    events: list[str] = []
    # 6 s: this run got 6 CPU seconds of 12, the cores were busy 12 s, of which 4.8 s went to other virtual machines
    windows = [(0, 0, 0, 0, 0), (6, 6, 12, 0, 4.8)]
    with Windows(windows, events) as share:
        share.after_step()
        assert torch.get_num_threads() == 1
    assert events == ["threads 2 -> 1: other processes use 0.2 of the cores and the hypervisor 0.8 (steal: other "
                      "virtual machines on them) and this run's threads got 50% of a core each"]


def test_a_slow_window_alone_or_a_short_one_changes_nothing_and_the_run_ends_on_the_plans_threads(two_threads):
    events: list[str] = []
    windows = [(0, 0, 0, 0),
               (sharing.WINDOW_S / 2, 0, 2, 0),  # too short to judge
               (6, 6, 6.2, 5.8),  # its threads got half a core each, but nobody else was busy: a wait, not a crowd
               (6, 6, 12, 0)]  # crowded: down to one
    with Windows(windows, events) as share:
        for _ in range(3):
            share.after_step()
        assert torch.get_num_threads() == 1
    assert len(events) == 1 and torch.get_num_threads() == 2  # the plan's again after the run


def test_the_cores_figures_are_this_machines():
    share = CoreShare(lambda message: None)
    wall0, mine0, busy0, idle0, _ = share._sample()
    cpu0 = time.process_time()
    while time.process_time() - cpu0 < 0.5:  # half a second of this process's CPU, however long a loaded machine takes
        pass
    wall, mine, busy, idle, _ = share._sample()
    spent = time.process_time() - cpu0
    assert abs((mine - mine0) - spent) < 0.1  # what the sampler counts is this process's CPU, clock ticks aside
    assert mine - mine0 <= (wall - wall0) * 1.2 + 0.05  # one busy thread
    assert busy - busy0 >= 0.4 and idle >= idle0
