"""Math answer verification: the completion's final answer equals the reference's, as a number or
as a mathematical expression.

Contract, as for every built-in reward: `fn(prompts, completions, **kwargs) -> list[float | None]`,
the reference in the data column `answer`, None for rows without one.

- The reference's final answer: after `####` (GSM8K), else the last `\\boxed{}` (MATH), else the
  whole string. The completion's: the last `\\boxed{}`, else an `<answer>` tag, else `####`, else
  the last number in the text. No answer found scores 0.0.
- Two answers are equal when the plain comparison says so (exact rational comparison of numbers
  with commas, `$`, unicode minus, `\\frac{a}{b}` and `3/4` understood; else equal normalised
  strings) or when math-verify (HuggingFace's `math_verify.parse`/`verify`, when installed) does:
  it adds LaTeX and symbolic equality (`x+1` == `1+x`, `\\sqrt{4}` == 2) and compares decimals
  rounded to 6 places (`0.333333` == `1/3`, where the plain comparison is exact).
- Percent: `50%` equals both `50` and `0.5` (math-verify's reading; the plain comparison follows it).
- math-verify bounds its work with `signal.alarm`, which only the main thread may use (its default
  raises ValueError elsewhere). In the main thread its timeouts are `timeout_s` seconds per parse
  and per comparison (a timeout scores 0.0); in any other thread they are off, so only short
  answers (<= 100 characters) with no power, factorial, `\\binom`, `\\prod` or `\\sum` go to it
  (sympy evaluates those eagerly: `9^{9^{9}}` had not finished after 60 s); the rest get the plain
  comparison only.
- math-verify reads letters as symbols, so products of the same letters compare equal (`apple` ==
  `paple`): use `posttrain.rewards.match:exact_match` for word answers.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

from posttrain.rewards.extract import boxed, hash_answer, last_number, tag
from posttrain.rewards.match import against_reference, normalize

try:
    from math_verify import parse as _mv_parse
    from math_verify import verify as _mv_verify
except ImportError:  # the plain comparison alone
    _mv_parse = _mv_verify = None

__all__ = ["answer_match", "completion_answer", "plain_equal", "reference_answer"]

# Off the main thread math-verify runs without a timeout: only answers this short, with none of
# these operators, are safe to hand it (sympy evaluates integer powers and factorials eagerly).
_NO_TIMEOUT_MAX_CHARS = 100
_NO_TIMEOUT_UNSAFE = re.compile(r"\^|\*\*|!|\\binom|\\prod|\\sum")


def reference_answer(reference: str) -> str:
    """The reference's final answer: `####` answer, else the last box, else the whole string."""
    return hash_answer(reference) or boxed(reference) or reference.strip()


def completion_answer(text: str) -> str | None:
    """The completion's final answer: last box, `<answer>` tag, `####`, last number; else None."""
    for extract in (boxed, tag, hash_answer, last_number):
        found = extract(text)
        if found:
            return found
    return None


# LaTeX and currency decorations around a number: \$, $, \!, \, (thin space), \left/\right, {,}
_DECORATIONS = re.compile(r"\\\$|\$|\\[!,;]|\\(?:left|right)|\{,\}|\\text\{\s*\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")


def _as_number(answer: str) -> tuple[Fraction, bool] | None:
    """(value, had a percent sign) when the whole answer is one number, else None."""
    text = _DECORATIONS.sub("", answer.translate(str.maketrans({"\u2212": "-"})))
    text = _FRAC.sub(r"(\1)/(\2)", text).replace(" ", "")
    percent = text.endswith("%")
    text = text.removesuffix("\\%").removesuffix("%") if percent else text
    text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    text = re.sub(r"^\((-?[\d.]+)\)/\((-?[\d.]+)\)$", r"\1/\2", text)  # "(3)/(4)" from \frac
    try:
        return Fraction(text), percent
    except (ValueError, ZeroDivisionError):  # not a number, or 10**4300+ digits
        return None


def plain_equal(reference: str, answer: str) -> bool:
    """The comparison without math-verify: exact rational equality, else equal normalised text."""
    ref_num, pred_num = _as_number(reference), _as_number(answer)
    if ref_num is not None and pred_num is not None:
        (ref, ref_pct), (pred, pred_pct) = ref_num, pred_num
        refs = {ref, ref / 100} if ref_pct else {ref}
        preds = {pred, pred / 100} if pred_pct else {pred}
        return not refs.isdisjoint(preds)
    return normalize(reference) == normalize(answer)


def math_verify_equal(reference: str, answer: str, timeout_s: int) -> bool:
    """math-verify's verdict (False when it is not installed, times out or cannot parse)."""
    if _mv_parse is None:
        return False
    if threading.current_thread() is threading.main_thread():
        timeout: int | None = timeout_s
    else:
        if any(
            len(s) > _NO_TIMEOUT_MAX_CHARS or _NO_TIMEOUT_UNSAFE.search(s)
            for s in (reference, answer)
        ):
            return False
        timeout = None
    # A box makes math-verify read the whole answer as one LaTeX expression.
    gold = _mv_parse(f"\\boxed{{{reference}}}", parsing_timeout=timeout)
    pred = _mv_parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
    return bool(gold and pred and _mv_verify(gold, pred, timeout_seconds=timeout))


def answer_match(
    prompts: list, completions: list, answer: list | None = None, timeout_s: int = 2, **kwargs
) -> list[float | None]:
    """1.0 where the completion's final answer equals the reference's, else 0.0; None without one."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
        raise ValueError(f"answer_match: timeout_s must be a whole number >= 1, got {timeout_s!r}")

    def same(completion: str, ref: str) -> float:
        gold, pred = reference_answer(ref), completion_answer(completion)
        if pred is None:
            return 0.0
        return float(plain_equal(gold, pred) or math_verify_equal(gold, pred, timeout_s))

    return against_reference("answer_match", completions, answer, same)
