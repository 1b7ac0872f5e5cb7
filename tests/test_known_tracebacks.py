"""Prefect's run loggers keep the message of our own failures and drop their traceback; any
other exception keeps its traceback."""

from __future__ import annotations

import logging
import sys

import pytest

from flows.stage_failures import QualityGateFailed, StageFailed
from flows.terminal import DropKnownTracebacks, quiet_known_failures


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord(
        "prefect.flow_runs", logging.ERROR, __file__, 1, "Encountered exception: %r", (exc,), info
    )


@pytest.mark.parametrize(
    ("exc", "keeps_traceback"),
    [
        (QualityGateFailed("grpo: held-out KL 10.9 exceeds max_kl 8.0"), False),
        (StageFailed("stage 'sft' exited with code 1"), False),
        (ValueError("a bug"), True),
    ],
)
def test_only_our_failures_lose_the_traceback(exc: BaseException, keeps_traceback: bool) -> None:
    record = _record(exc)
    assert DropKnownTracebacks().filter(record)
    text = logging.Formatter().format(record)
    assert ("Traceback" in text) is keeps_traceback
    assert repr(exc) in text


def test_installed_once_on_prefect_run_loggers(caplog: pytest.LogCaptureFixture) -> None:
    quiet_known_failures()
    quiet_known_failures()
    logger = logging.getLogger("prefect.flow_runs")
    assert sum(isinstance(f, DropKnownTracebacks) for f in logger.filters) == 1
    record = _record(QualityGateFailed("gate"))
    logger.handle(record)
    assert record.exc_info is None
