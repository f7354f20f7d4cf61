"""The training progress line: rate and ETA, and the warning that stop requests are polled
too rarely for a pre-emption to save."""

import logging
import time

from shardface.utils.progress import ProgressLogger, format_seconds


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _logged(poll_limit_s, step_s):
    logger, records = logging.getLogger("shardface"), _Records()
    logger.addHandler(records)
    level, logger.level = logger.level, logging.INFO
    try:
        progress = ProgressLogger(total_steps=100, frequent=5, samples_per_step=64, poll_limit_s=poll_limit_s)
        for step in (5, 10):
            time.sleep(5 * step_s)
            progress(step, 0, 1.0, 0.1, None)
    finally:
        logger.removeHandler(records)
        logger.level = level
    return records.lines


def test_polling_slower_than_the_stop_grace_is_warned_about_once():
    lines = _logged(poll_limit_s=0.05, step_s=0.02)  # 5 steps of 20 ms: 0.1 s between polls
    warnings = [line for line in lines if "lower --frequent" in line]
    assert len(warnings) == 1 and "5 steps take" in warnings[0], lines
    assert sum("step 10/100" in line for line in lines) == 1  # progress lines go on


def test_polling_within_the_stop_grace_is_not_warned_about():
    assert not [line for line in _logged(poll_limit_s=10.0, step_s=0.002) if "lower --frequent" in line]
    assert not [line for line in _logged(poll_limit_s=None, step_s=0.02) if "lower --frequent" in line]


def test_eta_format():
    assert (
        format_seconds(59) == "0:59"
        and format_seconds(3600 + 61) == "1:01:01"
        and format_seconds(-3) == "0:00"
    )


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _rates_and_etas(pause_s):
    """(samples/s, ETA) logged at steps 10 and 20 of 100, 1 s per step, with an evaluation
    of `pause_s` inside `paused()` after step 10."""
    logger, records = logging.getLogger("shardface"), _Records()
    logger.addHandler(records)
    level, logger.level = logger.level, logging.INFO
    clock = _Clock()
    try:
        progress = ProgressLogger(total_steps=100, frequent=10, samples_per_step=64, clock=clock)
        for step in (10, 20):
            clock.now += 10.0
            progress(step, 0, 1.0, 0.1, None)
            with progress.paused():
                clock.now += pause_s
    finally:
        logger.removeHandler(records)
        logger.level = level
    return [(line.split("samples/s")[0].split()[-1], line.split("ETA ")[1]) for line in records.lines]


def test_evaluation_time_is_out_of_samples_per_second_and_eta():
    assert (
        _rates_and_etas(pause_s=300.0) == _rates_and_etas(pause_s=0.0) == [("64.0", "1:30"), ("64.0", "1:20")]
    )
