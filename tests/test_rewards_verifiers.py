"""The built-in reward functions (posttrain/rewards/) against hand-written cases.

Each case says what the function must return and why; both of TRL's forms (plain strings and
chat messages) go through every function. The plain comparison that stands in for math-verify is
tested on its own.
"""

from __future__ import annotations

import threading
import time

import pytest

from posttrain.rewards import math as rmath
from posttrain.rewards.extract import boxed, completion_text, hash_answer, last_number, tag
from posttrain.rewards.format import missing_eos, tag_format
from posttrain.rewards.length import length_penalty
from posttrain.rewards.match import exact_match, normalize
from posttrain.rewards.math import answer_match, plain_equal


def conv(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


PROMPT_CONV = [{"role": "user", "content": "What is 14 + 39?"}]

# --- extract ---------------------------------------------------------------------------------


def test_completion_text_reads_both_forms() -> None:
    assert completion_text("plain") == "plain"
    assert completion_text(conv("chat")) == "chat"
    assert completion_text({"role": "assistant", "content": "one"}) == "one"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}]
    assert completion_text(parts) == "a"
    assert completion_text(None) == ""
    with pytest.raises(TypeError, match="got int"):
        completion_text(3)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("She pays 8 * 9 = <<8*9=72>>72 dollars.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### 12\n#### 1,000,000", "1000000"),  # the last ####
        ("#### -5 \nThanks for asking!", "-5"),  # text on later lines is not the answer
        ("#### 3, 4", "3, 4"),  # a list keeps its comma
        ("####   ", None),
        ("no marker 72", None),
    ],
)
def test_hash_answer(text: str, want: str | None) -> None:
    assert hash_answer(text) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        (r"so \boxed{5}", "5"),
        (r"\boxed{1} then \boxed{2}", "2"),  # the last box
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{ {a}^{ {2} } }.", "{a}^{ {2} }"),
        (r"\fbox{x+1}", "x+1"),
        (r"\boxed{5} and \boxed{\frac{1}{2", None),  # last box truncated: no stated answer
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not count
        ("boxed{5}", None),
        ("", None),
    ],
)
def test_boxed(text: str, want: str | None) -> None:
    assert boxed(text) == want


def test_tag() -> None:
    assert tag("<answer> 7 </answer>") == "7"
    assert tag("<answer>1</answer> <answer>\n2\n</answer>") == "2"
    assert tag("<think>a</think>", name="think") == "a"
    assert tag("<answer>open") is None
    assert tag("<answer.>x</answer.>", name="answer.") == "x"  # the name is literal, not a regex


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("The answer is 72.", "72"),  # a full stop is not a decimal point
        ("from -3 to 1,234", "1234"),
        ("it is \u22123", "-3"),  # unicode minus
        ("x = -0.5", "-0.5"),
        ("3/4 of the cake", "3/4"),
        ("5-3", "3"),  # a hyphen after a digit is subtraction, not a sign
        ("list 1,2,3", "3"),  # not a thousands separator
        ("about .5 left", ".5"),
        ("no digits", None),
        ("", None),
    ],
)
def test_last_number(text: str, want: str | None) -> None:
    assert last_number(text) == want


# --- match -----------------------------------------------------------------------------------


def test_normalize() -> None:
    assert normalize('  "The capital of France is  Paris."  ') == "the capital of france is paris"
    assert normalize('"Paris".') == "paris"
    assert normalize("\u201cPARIS\u201d") == "paris"
    assert normalize("apple\nriver   stone") == "apple river stone"
    assert normalize("3.5") == "3.5"
    assert normalize("") == ""


def test_exact_match_quickstart_references() -> None:
    answers = ["14 + 39 = 53.", "apple river stone", "14 + 39 = 53.", "There are 4 words.", None]
    completions = [
        conv(" 14 + 39 = 53 "),  # missing period and extra spaces: same answer
        "Apple River Stone.",
        conv("14 + 39 = 54."),
        "",  # empty completion
        "anything",
    ]
    prompts = [PROMPT_CONV, "Reverse the list: stone river apple", PROMPT_CONV, "p", "p"]
    got = exact_match(prompts, completions, answer=answers, task=["add"] * 5, stopped=[True] * 5)
    assert got == [1.0, 1.0, 0.0, 0.0, None]


def test_exact_match_needs_the_answer_column() -> None:
    with pytest.raises(TypeError, match="'answer'"):
        exact_match(["p"], ["c"])
    assert exact_match(["p"], ["c"], answer=["  "]) == [None]  # blank reference: none


# --- math ------------------------------------------------------------------------------------

MATH_CASES = [
    # (reference, completion, score)
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "So she sold \\boxed{72} clips.", 1.0),
    ("#### 72", "48 + 24 = 72 clips in all.", 1.0),  # last number
    ("#### 72", "#### 72 clips\nDone.", 0.0),  # the #### line is "72 clips": not a number
    ("#### 1,000", "the total is 1000", 1.0),
    ("#### 1000", "\\boxed{1,000}", 1.0),
    ("#### -3", "it drops to \u22123", 1.0),  # unicode minus
    ("#### -3", "\\boxed{3}", 0.0),
    ("\\boxed{\\frac{3}{4}}", "<answer>0.75</answer>", 1.0),
    ("\\boxed{0.75}", "<answer>3/4</answer>", 1.0),
    ("#### 50", "\\boxed{50\\%}", 1.0),  # percent: 50% == 50
    ("#### 0.5", "\\boxed{50\\%}", 1.0),  # and 50% == 0.5
    ("#### 72", "\\boxed{\\$72}", 1.0),
    ("#### 72", "", 0.0),  # empty completion
    ("#### 72", "I do not know.", 0.0),  # no answer at all
    ("#### 7", "\\boxed{7} is wrong, \\boxed{8}", 0.0),  # the last box counts
    ("\\boxed{\\{1, 2\\}}", "\\boxed{\\{1, 2\\}}", 1.0),  # same text
    ("Paris", "<answer> paris. </answer>", 1.0),  # whole-string reference, normalised text
]


@pytest.mark.parametrize(("reference", "completion", "score"), MATH_CASES)
def test_answer_match(reference: str, completion: str, score: float) -> None:
    # Both of TRL's forms give the same score, and other columns are ignored.
    assert answer_match(["q"], [completion], answer=[reference], stopped=[True]) == [score]
    assert answer_match([PROMPT_CONV], [conv(completion)], answer=[reference]) == [score]


def test_answer_match_symbolic_needs_math_verify() -> None:
    # What only math-verify knows: LaTeX and algebra. The plain comparison says no.
    import math_verify  # noqa: F401 (a dependency: fail, never skip, without it)

    for ref, pred in [("\\boxed{x+1}", "\\boxed{1+x}"), ("#### 2", "\\boxed{\\sqrt{4}}")]:
        assert answer_match(["q"], [pred], answer=[ref]) == [1.0]
        assert not plain_equal(rmath.reference_answer(ref), rmath.completion_answer(pred))
    assert answer_match(["q"], ["\\boxed{x+2}"], answer=["\\boxed{x+1}"]) == [0.0]


def test_answer_match_none_and_errors() -> None:
    assert answer_match(["q", "q"], ["1", "2"], answer=[None, "#### 2"]) == [None, 1.0]
    # A numeric answer column (ints, floats) reads as text.
    assert answer_match(["q"] * 3, ["\\boxed{72}", "so 0.5", "7"], answer=[72, 0.5, 8]) == [
        1.0,
        1.0,
        0.0,
    ]
    with pytest.raises(TypeError, match="'answer'"):
        answer_match(["q"], ["1"])
    with pytest.raises(ValueError, match="timeout_s"):
        answer_match(["q"], ["1"], answer=["1"], timeout_s=0)


@pytest.mark.parametrize(
    ("reference", "answer", "same"),
    [
        ("72", "72", True),
        ("72", "72.0", True),
        ("1,000", "1000", True),
        ("3/4", "0.75", True),
        ("\\frac{3}{4}", "0.75", True),
        ("\\dfrac{-1}{2}", "-0.5", True),
        ("-3", "\u22123", True),
        ("50", "50%", True),
        ("0.5", "50\\%", True),
        ("50%", "0.5", True),
        ("$72", "72", True),
        ("1/3", "0.333333", False),  # exact: no rounding in the plain comparison
        ("2", "3", False),
        ("The capital is Paris.", "the capital is paris", True),
        ("x+1", "1+x", False),  # no algebra without math-verify
        ("1/0", "1/0", True),  # not a number: compared as text
        ("", "0", False),
    ],
)
def test_plain_equal(reference: str, answer: str, same: bool) -> None:
    assert plain_equal(reference, answer) is same


def test_answer_match_without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    # As if math-verify were not installed: numbers still match, algebra does not.
    monkeypatch.setattr(rmath, "_mv_parse", None)
    monkeypatch.setattr(rmath, "_mv_verify", None)
    assert answer_match(
        ["q"] * 3,
        ["\\boxed{0.75}", "\\boxed{1+x}", "1,000"],
        answer=[
            "\\boxed{\\frac{3}{4}}",
            "\\boxed{x+1}",
            "#### 1000",
        ],
    ) == [1.0, 0.0, 1.0]


def test_answer_match_off_the_main_thread() -> None:
    # math-verify's default signal.alarm timeout raises ValueError outside the main thread; ours
    # turns it off there, and keeps answers that could compute for minutes away from it.
    import math_verify  # noqa: F401 (a dependency: fail, never skip, without it)

    out: dict[str, object] = {}

    def score() -> None:
        try:
            t0 = time.perf_counter()
            out["scores"] = answer_match(
                ["q"] * 3,
                ["\\boxed{1+x}", "\\boxed{\\frac{1}{2}}", "\\boxed{9^{9^{9}}}"],
                answer=["\\boxed{x+1}", "#### 0.5", "#### 1"],
            )
            out["seconds"] = time.perf_counter() - t0
        except Exception as e:  # reported below, so the test fails with the reason
            out["error"] = e

    worker = threading.Thread(target=score)
    worker.start()
    worker.join(timeout=30)
    assert "error" not in out, out.get("error")
    assert out["scores"] == [1.0, 1.0, 0.0]
    assert out["seconds"] < 5


def test_answer_match_timeout_in_the_main_thread() -> None:
    # 9^(9^9) has ~370 million digits: sympy would compute for minutes; the timeout scores 0.
    import math_verify  # noqa: F401 (a dependency: fail, never skip, without it)

    t0 = time.perf_counter()
    assert answer_match(["q"], ["\\boxed{9^{9^{9}}}"], answer=["#### 1"], timeout_s=1) == [0.0]
    assert time.perf_counter() - t0 < 4


# --- format ----------------------------------------------------------------------------------


def test_tag_format() -> None:
    completions = [
        "<think>12 + 30\nis 42</think>\n<answer>42</answer>",  # DOTALL: thinking spans lines
        conv("<think>x</think><answer>42</answer>\n"),  # trailing newline before EOS is fine
        "<answer>42</answer>",  # no thinking
        "<think>x</think><answer>42</answer> and more",  # text after the answer
        "",
    ]
    assert tag_format(["p"] * 5, completions) == [1.0, 1.0, 0.0, 0.0, 0.0]
    # A template whose generation prompt opens <think> itself: the recipe passes its own pattern.
    r1 = r"^.*?</think>\s*<answer>.*?</answer>$"
    assert tag_format(["p"], ["a</think><answer>1</answer>"], pattern=r1) == [1.0]
    with pytest.raises(ValueError, match="not a valid regex"):
        tag_format(["p"], ["x"], pattern="(")


def test_missing_eos() -> None:
    assert missing_eos(["p"] * 3, ["a", conv("b"), ""], stopped=[True, False, True]) == [
        0.0,
        -1.0,
        0.0,
    ]
    assert missing_eos(["p"], ["a"], stopped=[False], penalty=-0.5) == [-0.5]
    with pytest.raises(TypeError, match="'stopped'"):
        missing_eos(["p"], ["a"])


# --- length ----------------------------------------------------------------------------------


def test_length_penalty_boundaries() -> None:
    # max 10, buffer 4, penalty 2: free up to 6 tokens, then (6 - L) / 4 * 2, -2 past 10.
    lengths = [0, 6, 7, 8, 10, 11]
    ids = [[1] * n for n in lengths]
    got = length_penalty(
        ["p"] * 6, ["c"] * 6, completion_ids=ids, max_tokens=10, buffer=4, penalty=2.0
    )
    assert got == [0.0, 0.0, -0.5, -1.0, -2.0, -2.0]
    # DAPO's setting: 20480 / 4096; 18432 tokens is half-way down the ramp.
    dapo = length_penalty(["p"], ["c"], completion_ids=[[0] * 18432], max_tokens=20480, buffer=4096)
    assert dapo == [-0.5]


def test_length_penalty_errors() -> None:
    with pytest.raises(TypeError, match="'completion_ids'"):
        length_penalty(["p"], ["c"], max_tokens=10, buffer=2)
    with pytest.raises(TypeError, match="max_tokens"):
        length_penalty(["p"], ["c"], completion_ids=[[1]])
    with pytest.raises(ValueError, match="buffer"):
        length_penalty(["p"], ["c"], completion_ids=[[1]], max_tokens=10, buffer=11)
    with pytest.raises(ValueError, match="penalty"):
        length_penalty(["p"], ["c"], completion_ids=[[1]], max_tokens=10, buffer=2, penalty=-1)


def test_token_similarity_gives_ordered_partial_credit() -> None:
    from posttrain.rewards.match import token_similarity

    got = token_similarity(
        [""] * 5,
        [
            "10 28 52 53",  # sorted: full marks, as exact_match
            "53 52 28 10",  # the list reversed: one token in order, 2*1/(4+4)
            "The capital of France is Paris.",  # 5 of 6 tokens: 2*5/(6+6)
            [{"role": "assistant", "content": ""}],  # nothing: 0
            "anything",
        ],
        answer=["10 28 52 53", "10 28 52 53", "the capital of France is Lyon", "1 2", None],
    )
    assert got[:4] == pytest.approx([1.0, 0.25, 10 / 12, 0.0]) and got[4] is None


def test_pass_figures_by_hand() -> None:
    """Two prompts, n = 4 samples each, k = 2: prompt 0 greedy right, 3 of its 4 samples right
    (pass@2 = 1 - C(1,2)/C(4,2) = 1); prompt 1 greedy wrong, 1 of 4 right (pass@2 = 1 - C(3,2)/
    C(4,2) = 1 - 3/6 = 0.5). A prompt no verifier applied to (None) is not scored."""
    from posttrain.eval.verify import pass_figures

    greedy = [True, False, None]
    sampled = [True, True, False, True, False, True, False, False, None, None, None, None]
    out = pass_figures(greedy, sampled, n=4, k=2)
    assert out == {"pass@1": 0.5, "pass@2": 0.75, "sampled_pass@1": 0.5, "prompts": 2}
    # k = 1: the sampled pass@1 is sampled_pass@1; the greedy pass@1 keeps its key.
    assert pass_figures(greedy, sampled, n=4, k=1) == {
        "pass@1": 0.5, "sampled_pass@1": 0.5, "prompts": 2,
    }  # fmt: skip


def test_only_the_final_policy_samples_pass_at_k_by_default() -> None:
    """`evaluate.pass_k_policies`: `final` samples the final policy alone; `all` every policy
    compared; a list the named ones, and the final policy whatever the list says (its pass@k is
    the headline's)."""
    from posttrain.eval.verify import samples_pass_k

    compared = ["ingest", "sft", "dpo", "grpo"]
    final = "grpo"

    def sampled(setting: str | list[str]) -> list[str]:
        return [p for p in compared if samples_pass_k(p, final, setting)]

    assert sampled("final") == ["grpo"]
    assert sampled("all") == compared
    assert sampled(["sft"]) == ["sft", "grpo"]
    assert sampled([]) == ["grpo"]


def test_pass_figures_of_a_policy_not_sampled_hold_no_pass_at_k() -> None:
    """A policy evaluate did not sample has its greedy pass@1 and no pass@k key at all (not a
    zero the report would show as a measured figure)."""
    from posttrain.eval.verify import pass_figures

    assert pass_figures([True, False, None], None, n=4, k=2) == {"pass@1": 0.5, "prompts": 2}
