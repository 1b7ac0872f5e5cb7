"""Recognise credentials, so none is accepted in a recipe or written into a manifest or report.

Two kinds of evidence:
  - the shape of well-known tokens, wherever they appear in a string (`PATTERNS`): Hugging Face
    `hf_...`, OpenAI/Anthropic `sk-...`, AWS access key ids `AKIA...`/`ASIA...`, GitHub `ghp_...`
    and `github_pat_...`, Prefect Cloud `pnu_...`, Slack `xox?-...`, PEM private keys, and the
    password of a `scheme://user:password@host` URL;
  - a long, random-looking value under a key whose name says it holds one (`hf_token`,
    `api_key`, `password`, ...), for credentials with no recognisable prefix.

Manifests are full of sha256 digests and fingerprints (hex) and of token *counts*
(`max_new_tokens`, `tokenizer_sha256`): the patterns need their prefixes and a mix of letter
cases or digits, and key names match whole words, so those are never flagged (tests hold a list
of such near-misses). Detection is deliberately a small, readable set of rules: it is a safety
net against pasting a token into the wrong place, not a secret scanner.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

REDACTED = "***"

# The token must not continue a longer word: "task-..." or "ahf_..." are not tokens.
_START = r"(?<![A-Za-z0-9_\-])"
_END = r"(?![A-Za-z0-9])"

PATTERNS: dict[str, re.Pattern[str]] = {
    "Hugging Face token": re.compile(_START + r"hf_[A-Za-z0-9]{30,}" + _END),
    "API key (sk-...)": re.compile(_START + r"sk-[A-Za-z0-9_\-]{32,}" + _END),
    "AWS access key id": re.compile(_START + r"(?:AKIA|ASIA)[A-Z0-9]{16}" + _END),
    "GitHub token": re.compile(
        _START + r"(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{40,})" + _END
    ),
    "Prefect Cloud API key": re.compile(_START + r"pnu_[A-Za-z0-9]{36,}" + _END),
    "Slack token": re.compile(_START + r"xox[abposr]-[A-Za-z0-9\-]{20,}" + _END),
    # The whole block (to its END line, or to the end of a truncated text) is the secret.
    "private key": re.compile(
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----(?:[\s\S]*?-----END [A-Z0-9 ]*PRIVATE KEY-----|[\s\S]*)"
    ),
    # Only the password part is the secret; scheme, user and host stay readable.
    "password in a URL": re.compile(r"(?<=://)[^\s/:@]+:(?P<secret>[^\s/@]+)(?=@)"),
}

# Whole words of a key name (split at _ - . and case changes) that say the value is a secret.
_SECRET_WORDS = {"token", "secret", "password", "passwd", "passphrase", "credential", "credentials"}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("secret", "key"), ("private", "key")}
_SECRET_JOINED = {"apikey", "accesskey", "secretkey", "privatekey", "authtoken", "apitoken"}
# ...unless another word says it is a digest of something (`token_sha256`, `password_hash`).
_DIGEST_WORDS = {"sha", "sha1", "sha256", "sha512", "hash", "digest", "fingerprint", "checksum"}
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
_TOKENISH = re.compile(r"[A-Za-z0-9_\-+/=.~]{20,}")


# Character classes (lower, upper, digit) a token of this kind must mix. Slugs such as
# "sk-learn-compatible-estimators-2024" or "hf_datasetsandmodelsforeveryone" have the shape of
# a token but not its randomness; real ones are random base62.
_MIN_CLASSES = {"Hugging Face token": 2, "API key (sk-...)": 3, "GitHub token": 2}


def _random_enough(kind: str, text: str) -> bool:
    need = _MIN_CLASSES.get(kind)
    if need is None:
        return True
    body = text[3:] if kind == "API key (sk-...)" else text.split("_", 1)[-1]
    return sum(any(map(test, body)) for test in (str.islower, str.isupper, str.isdigit)) >= need


def _matches(text: str) -> Iterator[tuple[str, int, int]]:
    """(kind, start, end) of every secret-looking span in `text`."""
    for kind, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            if not _random_enough(kind, m.group(0)):
                continue
            group = "secret" if "secret" in pattern.groupindex else 0
            yield kind, m.start(group), m.end(group)


def secret_key_name(name: str) -> bool:
    """Does a key called `name` hold a credential? (`hf_token`, `apiKey`, `DB_PASSWORD`: yes;
    `max_new_tokens`, `tokenizer`, `template_sha256`, `token_sha256`, `key`: no)."""
    words = [w.lower() for w in _WORD.findall(name)]
    if not words or _DIGEST_WORDS.intersection(words):
        return False
    if _SECRET_WORDS.intersection(words) or _SECRET_JOINED.intersection(words):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(words, words[1:], strict=False))


def entropy_bits(text: str) -> float:
    """Shannon entropy per character of `text`."""
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in Counter(text).values()) if n else 0.0


def random_looking(value: str) -> bool:
    """A long token-shaped string (no spaces, no path separators) with the entropy of random
    characters: what a credential with no recognisable prefix looks like."""
    if not _TOKENISH.fullmatch(value) or value.startswith(("/", "./", "../", "~")):
        return False  # a path (`token_file: /run/secrets/hf`) is where a secret is, not one
    return entropy_bits(value) >= 3.5 and any(c.isdigit() for c in value)


def find_in_text(text: str) -> list[str]:
    """Kinds of secret found in a string, in pattern order, without repeats."""
    return list(dict.fromkeys(kind for kind, _, _ in _matches(text)))


def redact(text: str) -> str:
    """`text` with every secret-looking span replaced by `***`."""
    spans = sorted((s, e) for _, s, e in _matches(text))
    out, pos = [], 0
    for s, e in spans:
        if s < pos:  # overlapping matches of two patterns
            s = pos
            if s >= e:
                continue
        out.append(text[pos:s])
        out.append(REDACTED)
        pos = e
    out.append(text[pos:])
    return "".join(out)


def find_secrets(obj: Any, path: str = "") -> list[tuple[str, str]]:
    """(dotted path, kind) of every secret-looking value in a JSON-like structure."""
    found: list[tuple[str, str]] = []
    _walk(obj, path, None, found)
    return found


def _walk(obj: Any, path: str, key: str | None, found: list[tuple[str, str]]) -> None:
    if isinstance(obj, str):
        kinds = find_in_text(obj)
        if not kinds and key is not None and secret_key_name(key) and random_looking(obj):
            kinds = [f"credential under the key '{key}'"]
        found.extend((path or "<value>", k) for k in kinds)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            ks = str(k)
            if find_in_text(ks):
                found.append((f"{path}.{ks}" if path else ks, "secret-looking key"))
            _walk(v, f"{path}.{ks}" if path else ks, ks, found)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            _walk(v, f"{path}.{i}" if path else str(i), key, found)


def redact_obj(obj: Any, key: str | None = None) -> Any:
    """A copy of a JSON-like structure with secret-looking substrings replaced by `***`, and a
    random-looking value under a credential key replaced whole."""
    if isinstance(obj, str):
        if key is not None and secret_key_name(key) and random_looking(obj):
            return REDACTED
        return redact(obj)
    if isinstance(obj, dict):
        return {
            redact(k) if isinstance(k, str) else k: redact_obj(v, str(k)) for k, v in obj.items()
        }
    if isinstance(obj, list | tuple):
        return [redact_obj(v, key) for v in obj]
    return obj
