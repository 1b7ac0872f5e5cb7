"""What every `posttrain` command shares: exit codes and how a refused recipe is said."""

from __future__ import annotations

from collections.abc import Callable
from typing import TextIO, TypeVar

from posttrain.config.loader import RecipeError, load_recipe
from posttrain.config.schema import Recipe, ResolvedRecipe

R = TypeVar("R", bound=Recipe)

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_HUNG_UP = 129


def refused_head(path: str, problems: int) -> str:
    """The first line of a refusal, the same whether the schema or an input check refused."""
    return (
        f"posttrain: recipe {path} refused: {problems} problem{'s' * (problems != 1)} (nothing ran)"
    )


def load_or_report(path: str, overrides: list[str], err: TextIO) -> ResolvedRecipe | None:
    """The resolved recipe, or None after printing every problem as `field.path: message`."""
    return reported(load_recipe, path, overrides, err)


def reported(
    load: Callable[[str, list[str]], R], path: str, overrides: list[str], err: TextIO
) -> R | None:
    """`load(path, overrides)`, or None after printing every problem (`load_or_report`)."""
    try:
        return load(path, overrides)
    except RecipeError as exc:
        # One block, like a failed stage's (flows.failure_block): nothing ran, so no log.
        print(refused_head(path, len(exc.errors)), file=err)
        for line in exc.errors:
            print(f"  {line}", file=err)
        print(f"  fix:  {exc.fix}", file=err)
        return None
