"""JSON that strict readers accept: no NaN or Infinity literals.

Python's json writes `NaN` and `Infinity` by default; they are not JSON (RFC 8259), and jq, JavaScript,
Go and most dashboards refuse the whole file. A figure that does not exist (a held-out loss with no
held-out rows) or is not finite (a guarded NaN loss) is written as null instead.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps of `finite(obj)`, refusing anything non-finite that is left (allow_nan=False)."""
    default = kwargs.pop("default", str)
    # `default` converts objects json does not know (numpy/torch scalars) first, so their
    # non-finite values are caught too.
    return json.dumps(finite(obj), allow_nan=False, default=lambda o: finite(default(o)), **kwargs)
