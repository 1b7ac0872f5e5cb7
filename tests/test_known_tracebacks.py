"""Prefect's run loggers keep the message of our own failures and drop their traceback; any
other exception keeps its traceback."""

from __future__ import annotations

import logging
import sys

import pytest
from prefect.exceptions import FailedRun

from flows.failure_block import known_block, reason_line
from flows.stage.failures import QualityGateFailed, StageFailed
from flows.terminal import DropKnownTracebacks, quiet_known_failures
from posttrain.config.loader import RecipeError


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
        (RecipeError(["run.workspace: /x is outside the folders this worker allows (/w)"]), False),
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


def test_prefects_repeat_of_a_returned_failed_state_is_dropped_whole() -> None:
    # A served run's flow returns Failed(reason) (flows.post_train); Prefect's engine then
    # raises FailedRun and logs it as "Engine execution exited with unexpected exception".
    record = _record(FailedRun("recipe refused (no stage ran): run.workspace: ..."))
    assert not DropKnownTracebacks().filter(record)


def test_a_known_failure_reads_as_one_reason_line() -> None:
    refused = RecipeError(
        ["run.workspace: /x is outside the folders this worker allows (/w)", "sft.lr: > 0"]
    )
    assert reason_line(known_block(refused)) == (  # type: ignore[arg-type]
        "recipe refused (no stage ran): run.workspace: /x is outside the folders this worker "
        "allows (/w); sft.lr: > 0"
    )
    gate = known_block(QualityGateFailed("grpo: held-out KL 10.9 > grpo.max_kl 8.0"))
    assert reason_line(gate) == (  # type: ignore[arg-type]
        "stage grpo failed its quality gate: held-out KL 10.9 > grpo.max_kl 8.0"
    )
    assert known_block(ValueError("a bug")) is None
