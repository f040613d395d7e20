"""Whether other work keeps the CPUs busy (`profile_cache.machine_busy`), read from /proc/stat
samples given by hand: the share of all CPU time, over the window, that was neither idle nor
waiting on I/O, against `BUSY_SHARE`; False where /proc/stat cannot tell."""

from types import SimpleNamespace

import pytest

from rekv_core.plan import profile_cache as cache

# the first sample: user nice system idle iowait irq softirq steal guest guest_nice
BEFORE = (1000, 0, 1000, 8000, 100, 0, 0, 0, 0, 0)


def _stat(fields, cpu0=(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)) -> str:
    """A /proc/stat: the all-CPU line, then CPU 0's (which is not the machine's)."""
    return (f"cpu  {' '.join(map(str, fields))}\ncpu0 {' '.join(map(str, cpu0))}\n"
            "intr 12345 0 0\nctxt 678\n")


def _after(*deltas, before=BEFORE):
    return tuple(b + d for b, d in zip(before, deltas + (0,) * (len(before) - len(deltas))))


@pytest.fixture
def proc_stat(monkeypatch):
    """/proc/stat as a list of reads, one a sample (an exception: that read fails); no sleep."""
    reads = []

    class FakePath:
        def __init__(self, path):
            self.path = str(path)

        def read_text(self):
            if self.path != "/proc/stat":
                raise FileNotFoundError(self.path)
            text = reads.pop(0)
            if isinstance(text, Exception):
                raise text
            return text

    monkeypatch.setattr(cache, "Path", FakePath)
    monkeypatch.setattr(cache, "time", SimpleNamespace(sleep=lambda s: None))
    return reads


def test_a_machine_kept_busy_by_other_work_is_busy(proc_stat):
    # over the window: 150 user, 30 idle, 20 iowait of 200 ticks: 75% busy; CPU 0 alone idled
    idle_cpu0 = (0, 0, 0, 200, 0, 0, 0, 0, 0, 0)
    proc_stat += [_stat(BEFORE), _stat(_after(150, 0, 0, 30, 20), cpu0=idle_cpu0)]
    assert cache.machine_busy() is True


@pytest.mark.parametrize("deltas", [
    (60, 0, 0, 130, 10),  # 30% busy
    (40, 0, 0, 20, 140),  # waiting on the disk is not busy: 20%
    (100, 0, 0, 100, 0),  # exactly half: not more than BUSY_SHARE
])
def test_a_machine_that_idles_or_waits_on_io_is_not_busy(proc_stat, deltas):
    proc_stat += [_stat(BEFORE), _stat(_after(*deltas))]
    assert cache.machine_busy() is False


@pytest.mark.parametrize("columns", [4, 5])
def test_an_old_kernels_shorter_cpu_line_is_read(proc_stat, columns):
    """Kernels before 2.5.41 give four columns (no iowait), before 2.6.0 five."""
    before = BEFORE[:columns]
    proc_stat += [_stat(before), _stat(_after(150, 0, 0, 50, before=before))]
    assert cache.machine_busy() is True
    if columns == 5:  # its iowait counts as idle
        proc_stat += [_stat(before), _stat(_after(40, 0, 0, 20, 140, before=before))]
        assert cache.machine_busy() is False


def test_no_time_between_the_samples_tells_nothing(proc_stat):
    proc_stat += [_stat(BEFORE), _stat(BEFORE)]
    assert cache.machine_busy() is False


@pytest.mark.parametrize("reads", [
    [OSError("no /proc"), _stat(_after(150, 0, 0, 30, 20))],
    [_stat(BEFORE), PermissionError("/proc/stat")],
    ["cpu  not numbers\n", _stat(_after(150, 0, 0, 30, 20))],
])
def test_an_unreadable_proc_stat_is_not_busy(proc_stat, reads):
    proc_stat += reads
    assert cache.machine_busy() is False
