"""The base every recipe section model shares, in a module of its own so that section modules
kept apart from `run_sections` (`kubernetes_section`) can use it while `run_sections` uses them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Section(BaseModel):
    # extra="forbid": a misspelt key is an error that names it, never silently ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
