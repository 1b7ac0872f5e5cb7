"""A reward entry's `judge:` section: a model behind an OpenAI-compatible server that scores each
response by a rubric (`posttrain.rewards.judge`). No imports of the scoring code happen here."""

from __future__ import annotations

import string
from typing import Literal

from pydantic import model_validator

from posttrain.sections.fields import Execution, Result, _Section
from posttrain.sections.served import SERVER_URL_PATTERN, check_served

# The rubric's own placeholders; any other name is a data column of the rows.
RUBRIC_FIELDS = ("prompt", "completion")


class JudgeConfig(_Section):
    """A judge model: where it is served (`url` or `command`, exactly one), what it is asked
    (`rubric`, `system`) and how its reply becomes a score in [0, 1] (`score`)."""

    url: str | None = Execution(
        None,
        pattern=SERVER_URL_PATTERN,
        description="A running OpenAI-compatible server (`http://host:port`; requests go to "
        "`/v1/chat/completions`). The stage never stops it.",
    )
    command: str | list[str] | None = Execution(
        None,
        description="The command that starts a judge server for the stage, stopped when the "
        "stage ends, however it ends (as `rollout.server.command`): e.g. `transformers serve "
        "--host {host} --port {port}`. `{host}` (127.0.0.1), `{port}` (a free one) and "
        "`{model}` (this section's `model`) are filled in; its output goes to "
        "`logs/judge-<name>.log`.",
    )
    model: str = Result(
        min_length=1,
        source="served_model",
        description="The model name sent in each request; for `transformers serve`, a local "
        "model folder (relative to the recipe's folder, and inside the folders a recipe may "
        "read) or hub id it loads. A local folder enters the stage's fingerprint by its "
        "files, a name by its text.",
    )
    rubric: str = Result(
        min_length=1,
        description="The request's user message, a template: `{prompt}` (the conversation "
        "before the reply, as text), `{completion}` (the reply) and any data column of the "
        "rows (`{answer}`). Literal braces are doubled (`{{`).",
    )
    system: str | None = Result(None, description="An optional system message.")
    score: Literal["number", "choice"] = Result(
        "number",
        description="How the reply becomes a score. `number`: the number after `score:` or "
        "`rating:`, else the reply's last number, mapped from `range` to [0, 1] (outside the "
        "range: unparsed). `choice`: the choice the reply names (`A`, `[[A]]`, `Answer: A`; "
        "case-insensitive), scored by `choices`.",
    )
    range: tuple[float, float] = Result(
        (0.0, 10.0), description="`score: number`: the rubric's scale [lo, hi], mapped to [0, 1]."
    )
    choices: dict[str, float] = Result(
        default_factory=dict,
        description="`score: choice`: each choice's score, e.g. `{A: 1.0, B: 0.0}`.",
    )
    max_tokens: int = Result(16, ge=1, description="Longest judge reply, in tokens.")
    temperature: float = Result(0.0, ge=0, description="The judge's sampling temperature.")
    on_failure: Literal["zero", "skip", "fail"] = Result(
        "zero",
        description="What a reply that cannot be parsed, or no reply after `retries`, scores: "
        "`zero` (0.0), `skip` (None: not applicable, left out of the sum and the mean) or "
        "`fail` (the stage fails naming the judge, the row and the last reply or error).",
    )
    timeout_s: float = Execution(60.0, gt=0, description="Seconds one request may take.")
    retries: int = Execution(
        2, ge=0, description="Retries of a failed request (error, timeout), with backoff."
    )
    max_concurrency: int = Execution(8, ge=1, description="Requests in flight at once per rank.")
    api_key_env: str | None = Execution(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The NAME of an environment variable holding the server's API key (sent as "
        "`Authorization: Bearer`); the key itself is never logged nor fingerprinted.",
    )
    startup_timeout_s: float = Execution(
        900.0, gt=0, description="`command`: seconds the server may take to become healthy."
    )
    health_path: str = Execution(
        "/health", pattern=r"^/", description="`command`: GET path that answers 200 once up."
    )

    @model_validator(mode="after")
    def _consistent(self) -> JudgeConfig:
        check_served("judge", self.url, self.command)
        self._check_rubric()
        lo, hi = self.range
        if self.score == "number" and not lo < hi:
            raise ValueError(f"judge.range: [{lo:g}, {hi:g}] needs lo < hi")
        if self.score == "choice" and not self.choices:
            raise ValueError("judge.choices: `score: choice` needs choices, e.g. {A: 1.0, B: 0.0}")
        return self

    def _check_rubric(self) -> None:
        try:
            names = placeholders(self.rubric)
        except ValueError as exc:  # an unmatched brace
            raise ValueError(
                f"judge.rubric: {exc} (write a literal brace as {{{{ or }}}})"
            ) from None
        if "completion" not in names:
            raise ValueError(
                "judge.rubric: no {completion} placeholder; the judge would never see the reply"
            )
        bad = [n for n in names if not n.isidentifier()]
        if bad:
            raise ValueError(
                f"judge.rubric: placeholder {{{bad[0]}}} is not a name; use {{prompt}}, "
                "{completion} or a data column such as {answer}"
            )

    @property
    def columns(self) -> list[str]:
        """The data columns the rubric reads."""
        return [n for n in placeholders(self.rubric) if n not in RUBRIC_FIELDS]


def placeholders(template: str) -> list[str]:
    """The `{name}` fields of a format string, in order, once each (ValueError if malformed)."""
    out: list[str] = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name is not None and name not in out:
            out.append(name)
    return out
