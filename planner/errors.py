"""The one exception type a user can cause.

Anything raised as ``UserError`` is printed by the CLI as a single clear message and the
process exits with status 2; every other exception is a bug and may show a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the input and says how to fix it."""

    exit_code = 2


def describe_validation_error(source: str, err: Exception) -> str:
    """Turn a pydantic ValidationError into one message naming the source and the fields."""
    errors = getattr(err, "errors", None)
    if errors is None:
        return f"{source}: {err}"
    parts = []
    for item in errors():
        loc = ".".join(str(x) for x in item.get("loc", ()) if x != "__root__") or "(top level)"
        parts.append(f"{loc}: {item.get('msg', 'invalid value')}")
    return f"{source}: invalid field(s): " + "; ".join(parts)
