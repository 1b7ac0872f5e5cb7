"""The base every recipe section model shares."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
