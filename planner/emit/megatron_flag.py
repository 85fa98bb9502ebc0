"""One Megatron-LM command-line flag as the run directory writes it (megatron_args.sh)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Arg(BaseModel):
    """One flag and its value; ``raw`` values are shell expressions (e.g. "$RUN_DIR/ds_config.json")."""

    model_config = ConfigDict(frozen=True)

    flag: str
    value: str | None = None
    raw: bool = False


def _a(flag: str, value: object = None, raw: bool = False) -> Arg:
    if isinstance(value, float):
        value = format(value, ".6g")
    return Arg(flag=flag, value=None if value is None else str(value), raw=raw)
