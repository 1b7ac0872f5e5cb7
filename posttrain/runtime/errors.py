"""Known conditions a stage reports as a verdict, not as a crash.

`stage_main` prints such an error as one `POSTTRAIN_ERROR stage <name> failed: <Type>: <message>`
line, without a traceback on stderr (the traceback still goes to `logs/error.txt`): the message
names what is wrong and what to do, and a wall of frames above it would only hide that.
"""

from __future__ import annotations


class StageVerdict(Exception):
    """A stage cannot go on for a reason its message fully explains."""


class NoIntactCheckpoint(StageVerdict):
    """Every checkpoint of a training stage is damaged and `infra.no_intact_checkpoint` is `fail`."""


class ParentArtifactDamaged(StageVerdict):
    """A parent stage's artifact no longer matches its manifest."""
