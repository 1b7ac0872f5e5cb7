"""Where a model is served, as a rollout server (`rollout.server`) and a judge (`judge:`) both
say it: a server that already runs (`url`) or a command the stage starts, whose `{host}`,
`{port}` and `{model}` are filled in when it starts."""

from __future__ import annotations

import string

# What a server `command` may contain, filled in when the stage starts the server.
SERVER_PLACEHOLDERS = ("host", "port", "model")
SERVER_URL_PATTERN = r"^https?://[^\s/]+(/.*)?$"


def check_served(where: str, url: str | None, command: str | list[str] | None) -> None:
    """ValueError unless exactly one of `url` and `command` is given, and the command names
    only known placeholders; `where`: the section's field path (`rollout.server`, `judge`)."""
    if (url is None) == (command is None):
        raise ValueError(
            f"{where}: give `url` (a server that runs) or `command` (one the stage starts), "
            "exactly one"
        )
    for part in [command] if isinstance(command, str) else list(command or []):
        for _, name, _, _ in string.Formatter().parse(part):
            if name is not None and name not in SERVER_PLACEHOLDERS:
                raise ValueError(
                    f"{where}.command: unknown placeholder {{{name}}}; known: "
                    + ", ".join(f"{{{p}}}" for p in SERVER_PLACEHOLDERS)
                )
