"""Token-level distillation's teacher must tokenize like its student: checked when the recipe is
resolved (so `posttrain validate`, `plan` and `run` refuse before anything runs), for every
stage whose kind compares the two models' next-token distributions id by id
(`StageKind.token_teacher`: distill). An SFT teacher writes text and may tokenize any way.

What each base tokenizes with, as far as it is known without running ingest:
  - from_config: the BPE ingest trains from `TOKENIZER_FIELDS` and `run.seed` (one per recipe),
    whatever the width: two from_config bases agreeing on those fields share one vocabulary,
    any field apart refuses (posttrain.stages.ingest.from_config_tokenizer);
  - a local folder: its tokenizer, read now (the token table's sha256, `vocab_digest`);
  - a hub id: its tokenizer from the local Hugging Face cache, never the network; not cached
    (or not readable without remote code): not checked here, the stage checks at its start
    (`posttrain.models.teacher.build_teacher`).
A from_config base and a checkpoint never share a vocabulary. Tokenizers are read once per
folder and revision per process, without torch when the folder has a tokenizer.json.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from posttrain.hub import cached_snapshot, is_hub_id
from posttrain.kinds import ROLE_FIELDS
from posttrain.kinds.ingest import TOKENIZER_FIELDS
from posttrain.models.vocab import mismatch_text, vocab_difference

log = logging.getLogger("posttrain.config")


def vocab_errors(recipe: Any) -> list[str]:
    """One `stages.<name>.teacher: ...` line per token-level teacher whose base tokenizes with
    another vocabulary than the student's base."""
    graph = recipe.graph()
    errors = []
    for s in graph:
        teacher = s.links.get("teacher")
        if not s.kind.token_teacher or teacher is None:
            continue
        student_base, teacher_base = s.base, graph.base_of(teacher)
        if student_base == teacher_base:
            continue
        names = (
            f"{s.name!r} (base {student_base!r})",
            f"{teacher!r}" + ("" if teacher == teacher_base else f" (base {teacher_base!r})"),
        )
        bases = (graph.bases[student_base].section, graph.bases[teacher_base].section)
        if problem := _mismatch(*bases, recipe.run.seed, names):
            errors.append(f"{s.where}.{ROLE_FIELDS['teacher']}: {problem}")
    return errors


def _mismatch(student: Any, teacher: Any, seed: int, names: tuple[str, str]) -> str | None:
    """Why base section `teacher` cannot teach base section `student` token by token; None
    when they tokenize alike or when that is not known yet."""
    built = (student.source == "from_config", teacher.source == "from_config")
    if all(built):
        differ = [
            f"{f} {getattr(student.from_config, f)!r} vs {getattr(teacher.from_config, f)!r}"
            for f in TOKENIZER_FIELDS
            if getattr(student.from_config, f) != getattr(teacher.from_config, f)
        ]
        if not differ:
            return None
        detail = "both from_config, their tokenizer fields differ: " + ", ".join(differ)
        return mismatch_text(*names, f"{detail}; seed {seed}")
    if any(built):
        built_one = names[0] if built[0] else names[1]
        return mismatch_text(
            *names,
            f"the base of {built_one} is built from_config with a BPE of its own, the other is "
            "a checkpoint with its own tokenizer",
        )
    s, t = _tokenizer(student), _tokenizer(teacher)
    if s is None or t is None:
        return None  # not readable now: the stage compares them when it loads the teacher
    detail = vocab_difference(s, t)
    return None if detail is None else mismatch_text(*names, detail)


def _tokenizer(section: Any) -> Any | None:
    """The tokenizer of a path base: its folder's, or the hub id's in the local cache; None when
    it cannot be read now."""
    path = str(section.path)
    if is_hub_id(path):
        folder = cached_snapshot(path, section.revision)
        if folder is None:
            log.info(
                "vocabulary check: %s@%s not cached; left to the stage", path, section.revision
            )
            return None
    else:
        folder = Path(path)
    if not folder.is_dir():
        return None
    stamp = tuple(
        (p.name, p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(folder.glob("*token*"))
        if p.is_file()
    )
    return _read_tokenizer(str(folder.resolve()), stamp)


@functools.lru_cache(maxsize=16)
def _read_tokenizer(folder: str, stamp: tuple[Any, ...]) -> Any | None:
    """The tokenizer in `folder` (local files only), cached by folder and its tokenizer files'
    sizes and times (`stamp`). A tokenizer.json is read as a fast tokenizer (no torch import);
    otherwise AutoTokenizer. None when neither reads it (say, it needs remote code)."""
    try:
        if (Path(folder) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # any reader failure: the stage checks at its start
        log.info("vocabulary check: the tokenizer in %s is not readable now (%s)", folder, exc)
        return None
