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
    if vocab_digest(student) == vocab_digest(teacher):
        return None
    s, t = student.get_vocab(), teacher.get_vocab()
    differ = sorted(k for k in set(s) | set(t) if s.get(k) != t.get(k))
    return (
        f"the teacher {names[1]!r} tokenizes with another vocabulary than the student "
        f"{names[0]!r} ({len(t)} tokens vs {len(s)}; {len(differ)} differ, e.g. "
        f"{', '.join(repr(k) for k in differ[:3])}): token-level distillation needs one "
        "vocabulary; pick a teacher of the student's family, or distil off-policy (an sft "
        "stage with `teacher:`, which learns from the teacher's text)"
    )


def shared_vocab_size(tokenizer: Any) -> int:
    """Logit columns both models' heads hold for real tokens: the tokenizer's length. Heads are
    often padded past it, to different sizes within one family (Qwen2.5-0.5B 151,936 rows,
    -7B 152,064), so both models' logits are sliced to this before they are compared."""
    return len(tokenizer)
