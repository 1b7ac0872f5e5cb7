"""A stage on one rank, then on 2 ranks of one sequence-parallel group (N = 2) in the same folder
(or any two layouts, `in_place`), for the tests that prove the split run equals the unsplit one
(tests/test_*sequence_parallel*)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.telemetry.records import read_metrics
from tests.stage_helpers import planned_dir, run_inprocess, run_torchrun

SP = ("infra.devices_per_node=2", "infra.sequence_parallel=2")


@dataclass
class Runs:
    """Both runs' train and eval records and trained files (paths under the stage's folder),
    and the split run's output."""

    folder: Path
    output: str
    one_train: list[dict]
    one_eval: list[dict]
    one_files: dict[str, dict[str, torch.Tensor]]
    two_train: list[dict]
    two_eval: list[dict]
    two_files: dict[str, dict[str, torch.Tensor]]

    def worst_weight_gap(self) -> float:
        """The largest elementwise difference between the runs' trained files."""
        gaps = [0.0]
        for f, mine in self.one_files.items():
            theirs = self.two_files[f]
            assert theirs.keys() == mine.keys(), f
            gaps += [(theirs[k] - mine[k]).abs().max().item() for k in mine]
        return max(gaps)


def one_then_two(
    kind: str, recipe: Path, files: tuple[str, ...] = ("adapter/adapter_model.safetensors",)
) -> Runs:
    """Run `kind` on 1 rank, then on 2 ranks at N = 2 in its place (how the batch is split over
    ranks is not fingerprinted, so both plan the same folder)."""
    return in_place(kind, recipe, (1, ()), (2, SP), files)


def in_place(
    kind: str,
    recipe: Path,
    first: tuple[int, tuple[str, ...]],
    then: tuple[int, tuple[str, ...]],
    files: tuple[str, ...] = ("adapter/adapter_model.safetensors",),
) -> Runs:
    """Run `kind` on `first` (ranks, overrides: in this process for 1 rank, else torchrun), then
    on `then` in its place (the same planned folder: ranks and micro-batch sizes are not
    fingerprinted); the split run is `then`."""

    def launch(ranks: int, over: tuple[str, ...]) -> tuple[Path, str]:
        if ranks == 1:
            return run_inprocess(kind, recipe, *over), ""
        out = planned_dir(kind, recipe, *over)
        proc = run_torchrun(kind, recipe, ranks, *over)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return out, proc.stdout + proc.stderr

    def records(out: Path) -> tuple[list[dict], list[dict], dict[str, dict[str, torch.Tensor]]]:
        metrics = out / "metrics.jsonl"
        trained = {f: load_file(out / f) for f in files}
        return read_metrics(metrics, "train"), read_metrics(metrics, "eval"), trained

    one, _ = launch(*first)
    before = records(one)
    assert planned_dir(kind, recipe, *then[1]) == one
    shutil.rmtree(one)
    two, text = launch(*then)
    return Runs(two, text, *before, *records(two))
