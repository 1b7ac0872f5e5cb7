"""Known conditions a stage reports as a verdict, not as a crash.

`stage_main` prints such an error as one `POSTTRAIN_ERROR stage <name> failed: <Type>: <message>`
line, without a traceback on stderr (the traceback still goes to `logs/error.txt`): the message
names what is wrong and what to do, and a wall of frames above it would only hide that.
"""

from __future__ import annotations

# The start of that line; the supervisor finds a stage's verdict by it (`flows.failure_block`).
ERROR_MARKER = "POSTTRAIN_ERROR stage "


class StageVerdict(Exception):
    """A stage cannot go on for a reason its message fully explains."""


class NoIntactCheckpoint(StageVerdict):
    """Every checkpoint of a training stage is damaged and `infra.no_intact_checkpoint` is `fail`."""


class ParentArtifactDamaged(StageVerdict):
    """A parent stage's artifact no longer matches its manifest."""


class StaleSampler(StageVerdict):
    """A rollout engine that holds weights of its own scores tokens otherwise than the trainer's
    weights do: the `fast` engine's copy on a fixed probe (`posttrain.rl.rollout.probe`), a
    rollout server on the tokens it sampled (`posttrain.rl.rollout.server_probe`)."""


class RecipeVerdict(StageVerdict, ValueError):
    """A recipe value a stage refuses at run time, where only the run shows the problem (the
    number of ranks, the model's architecture, the rows left once data is encoded); `validate`
    checks the rest before anything runs. The message starts with the field's path.

    `field` is a path within the stage's own section (`batch.padding_free`) unless `section`
    names the section outright (`infra`, `stages.dpo2`): code below a stage does not know
    whether its section is `dpo` or `stages.dpo2`, so `stage_main` fills `section` in with the
    failing stage's before it reports the verdict."""

    def __init__(self, field: str, problem: str, section: str | None = None) -> None:
        super().__init__(field, problem)
        self.field, self.problem, self.section = field, problem, section

    @property
    def path(self) -> str:
        """The field's full path once `section` is known (`dpo.batch.padding_free`)."""
        return f"{self.section}.{self.field}" if self.section else self.field

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"
