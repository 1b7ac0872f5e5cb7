"""Whether two tokenizers share one vocabulary: token-level distillation compares the student's
and the teacher's next-token distributions id by id, so the same id must be the same token in
both. Light (no torch): the planner compares tokenizers before anything loads a model."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def vocab_digest(tokenizer: Any) -> str:
    """sha256 of the tokenizer's token -> id table (added and special tokens included)."""
    table = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()


def vocab_mismatch(student: Any, teacher: Any, names: tuple[str, str]) -> str | None:
    """Why `teacher`'s tokenizer cannot teach `student`'s token by token, or None when both map
    every token to the same id. `names`: (the student's, the teacher's) as the recipe names
    them, for the message."""
    detail = vocab_difference(student, teacher)
    return None if detail is None else mismatch_text(repr(names[0]), repr(names[1]), detail)


def vocab_difference(student: Any, teacher: Any) -> str | None:
    """How two tokenizers' token tables differ (sizes, a few tokens), or None when they are one."""
    if vocab_digest(student) == vocab_digest(teacher):
        return None
    s, t = student.get_vocab(), teacher.get_vocab()
    differ = sorted(k for k in set(s) | set(t) if s.get(k) != t.get(k))
    return (
        f"{len(t)} tokens vs {len(s)}; {len(differ)} differ, e.g. "
        f"{', '.join(repr(k) for k in differ[:3])}"
    )


def mismatch_text(student: str, teacher: str, detail: str) -> str:
    """The refusal of a teacher of another vocabulary: `student`, `teacher` as the message
    names them (quoted, with their bases when the plan tells them apart), `detail` how they
    differ."""
    return (
        f"the teacher {teacher} tokenizes with another vocabulary than the student {student} "
        f"({detail}): token-level distillation needs one vocabulary; pick a teacher of the "
        "student's family, or distil off-policy (an sft stage with `teacher:`, which learns "
        "from the teacher's text)"
    )


def shared_vocab_size(tokenizer: Any) -> int:
    """Logit columns both models' heads hold for real tokens: the tokenizer's length. Heads are
    often padded past it, to different sizes within one family (Qwen2.5-0.5B 151,936 rows,
    -7B 152,064), so both models' logits are sliced to this before they are compared."""
    return len(tokenizer)
