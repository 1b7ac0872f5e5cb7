"""Prefect logs every exception that ends a flow or task run with its full traceback. For the
failures posttrain itself raises and explains (a stage that failed, timed out or hung, a quality
gate not met), that traceback is a wall of orchestration frames above the one line a person needs,
which the CLI prints last anyway. These records keep their message and lose the traceback; any
other exception (a bug) keeps it.
"""

from __future__ import annotations

import logging

from flows.post_train import QualityGateFailed
from flows.stage_failures import StageFailed

KNOWN_FAILURES: tuple[type[BaseException], ...] = (StageFailed, QualityGateFailed)
PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class DropKnownTracebacks(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KNOWN_FAILURES):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_known_failures() -> None:
    """Install the filter on Prefect's run loggers (once per process)."""
    for name in PREFECT_RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropKnownTracebacks) for f in logger.filters):
            logger.addFilter(DropKnownTracebacks())
