"""The models the speed benches share: the two Llama shapes of `sft_throughput.py` (and the
benches that compare against it), a LoRA r16 model of one built from config, the ingest
section that builds one in a workspace, the parents the RL benches' stages start from, and a
stage run in the bench's own process. Imported by the bench scripts (which put this folder on
sys.path), never by the project."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 2048
SIZES = {
    "small": {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "intermediate_size": 256},
    "medium": {"hidden_size": 256, "num_layers": 6, "num_heads": 8, "intermediate_size": 688},
}


class _Tok:
    """What `posttrain.models.tiny.build_model` reads of a tokenizer."""

    pad_token_id, eos_token_id = 0, 1

    def __len__(self) -> int:
        return VOCAB


def lora_model(shape: dict[str, int]) -> Any:
    """A random-init Llama of `shape` with LoRA r16/alpha 32 (the project's default targets)."""
    from posttrain.kinds.ingest import FromConfigModel
    from posttrain.models.lora import apply_lora
    from posttrain.models.tiny import build_model
    from posttrain.sections.shared import LoraConfig

    return apply_lora(
        build_model(FromConfigModel(**shape, vocab_size=VOCAB), _Tok()),
        LoraConfig(r=16, alpha=32),
    )


def ingest_section(shape: dict[str, int]) -> dict[str, Any]:
    """A recipe's `ingest`: a base of `shape` built from config, without pre-training."""
    return {
        "source": "from_config",
        "from_config": {
            **shape,
            "vocab_size": VOCAB,
            "max_position_embeddings": 256,
            "pretrain_steps": 0,
            "corpus_examples": 2000,
        },
    }


def rl_parents(
    ws: Path, hidden: int, layers: int, threads: int, warmup_steps: int = 100, sft_steps: int = 30
) -> dict[str, Any]:
    """A recipe's run, infra, ingest (a Llama of `hidden` x `layers`, warmed up) and sft (the
    quickstart task) sections: what the RL benches add a stage to."""
    return {
        "run": {"name": "rl-bench", "workspace": str(ws), "seed": 0},
        "infra": {"device": "cpu", "devices_per_node": 1, "threads_per_rank": threads},
        "ingest": {
            "source": "from_config",
            "from_config": {
                "hidden_size": hidden,
                "num_layers": layers,
                "num_heads": max(1, hidden // 64),
                "intermediate_size": hidden * 2,
                "vocab_size": 1024,
                "max_position_embeddings": 256,
                "pretrain_steps": warmup_steps,
                "corpus_examples": 800,
            },
        },
        "sft": {
            "data": {"synthetic": {"n_examples": 400}, "eval_fraction": 0.1},
            "batch": {"micro_batch_size": 16, "grad_accum_steps": 1},
            "max_steps": sft_steps,
            "checkpoint_every": 0,
        },
    }


def stage_helpers() -> Any:
    # tests/ is a namespace package next to posttrain/: importable once the repository root is
    # on sys.path (a script's own folder, bench/, is what Python puts there).
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import tests.stage_helpers as helpers

    return helpers


def run_stage(kind: str, path: Path) -> Path:
    """Run the recipe's stage of `kind` through its real entry point here, this process its
    supervisor (`tests/stage_helpers.run_inprocess`); its folder."""
    return stage_helpers().run_inprocess(kind, path)


@contextlib.contextmanager
def stage_process(
    stage: str, recipe: Path, *overrides: str, name: str | None = None
) -> Iterator[list[str]]:
    """The command line of the recipe's stage `name` (else its stage of kind `stage`) as a
    process of its own, this process its supervisor for the block: it holds the artifact's
    lock and names it in the spec (`tests/stage_helpers.planned_launch`). What a bench times
    is then the stage alone, not a supervisor's start-up."""
    with stage_helpers().planned_launch(stage, recipe, *overrides, name=name) as spec:
        if spec is None:
            raise SystemExit(f"{name or stage} is complete already in {recipe}'s workspace")
        yield [sys.executable, "-m", f"posttrain.stages.{stage}", "--spec", str(spec)]
