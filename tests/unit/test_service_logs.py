"""The log readers the system tests use (tests/support/service_logs.py)."""

import threading

import pytest

from tests.support.service_logs import logged_at, wait_for_line

LOG = ("2026-12-07 06:37:26,426 INFO rekv.decode.pool: prefill pool: added 127.0.0.1:36125\n"
       "2026-12-07 06:37:31,531 INFO rekv.serve: decode service ready: {}\n")


def test_a_lines_time_is_read_from_its_stamp_wherever_the_offset_falls_in_it():
    added, ready = LOG.find("prefill pool: added"), LOG.find("decode service ready")
    assert logged_at(LOG, ready) - logged_at(LOG, added) == pytest.approx(5.105)
    assert logged_at(LOG, 0) == logged_at(LOG, added)  # the first line: no newline before it
    assert logged_at(LOG, len(LOG) - 2) == logged_at(LOG, ready)


def test_the_log_is_returned_once_it_holds_the_line_or_as_it_is_at_the_deadline(tmp_path):
    path = tmp_path / "decode.log"
    path.write_text(LOG)
    later = threading.Timer(0.3, lambda: path.write_text(LOG + "link probe from x\n"))
    later.start()
    assert wait_for_line(path, "link probe from", 30).endswith("link probe from x\n")
    later.join()
    assert wait_for_line(path, "never logged", 0.3) == LOG + "link probe from x\n"
