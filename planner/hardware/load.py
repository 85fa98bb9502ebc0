"""Find and load hardware profiles: a built-in name (``dgx-a100-80g``) or a user's YAML file.

Everything a user can get wrong here (unknown name, missing file, malformed YAML, wrong
types, zero or negative numbers, unknown fields) becomes one ``UserError`` naming the file
and the field, so the CLI exits with status 2 and no traceback.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from planner.errors import UserError, arg, describe_validation_error
from planner.hardware.profile import HardwareProfile
from planner.limits import nesting, path_kind, profile_why, shown_path, shown_text
from planner.resources import hardware_profiles_dir

DEFAULT_PROFILE = "dgx-a100-80g"

# Short names people type; each maps to exactly one built-in profile.
ALIASES = {
    "default": DEFAULT_PROFILE,
    "a100": "dgx-a100-80g",
    "a100-80g": "dgx-a100-80g",
    "a100-40g": "dgx-a100-40g",
    "h100": "dgx-h100",
    "h200": "hgx-h200",
    "l40s": "l40s-pcie",
    "gb200": "gb200-nvl72",
    "gb300": "gb300-nvl72",
}

_SCHEMA_HINT = "see hardware_profiles/README.md for the schema"


def list_profiles() -> list[str]:
    """Names of the built-in profiles, sorted."""
    return sorted(p.stem for p in hardware_profiles_dir().glob("*.yaml"))


def builtin_profile_path(name: str) -> Path | None:
    """The YAML file of a built-in profile (name or alias, any case), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    path = hardware_profiles_dir() / f"{key}.yaml"
    return path if path_kind(path) == "file" else None


def load_profile(name_or_path: str = DEFAULT_PROFILE) -> HardwareProfile:
    """A built-in profile by name (case-insensitive, aliases allowed) or a profile YAML file."""
    text = str(name_or_path).strip()
    if not text:
        raise UserError(f"{arg('hardware')}: empty value; give a profile name (see `dsplan hardware`) or a YAML file")
    builtin = None if _looks_like_path(text) else builtin_profile_path(text)
    if builtin is not None:
        return _load_file_cached(str(builtin), builtin.stat().st_mtime_ns)
    path = Path(text).expanduser()
    kind = path_kind(path)
    if kind == "file":
        resolved = path.resolve()
        return _load_file_cached(str(resolved), resolved.stat().st_mtime_ns)
    if kind == "dir":
        raise UserError(f"hardware profile {text} is a directory; "
                        "give one YAML file (schema: hardware_profiles/README.md)")
    if _looks_like_path(text):
        raise UserError(f"hardware profile file {shown_path(text)} not found; "
                        "give an existing YAML file or a built-in name (`dsplan hardware`)")
    raise UserError(_unknown_name_message(text))


def _looks_like_path(text: str) -> bool:
    return "/" in text or "\\" in text or text.lower().endswith((".yaml", ".yml"))


def _unknown_name_message(name: str) -> str:
    import difflib  # only for a mistyped name: off the start-up path

    known = list_profiles()
    close = difflib.get_close_matches(name.lower(), known + list(ALIASES), n=3, cutoff=0.5)
    close = list(dict.fromkeys(ALIASES.get(c, c) for c in close))
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return (
        f"unknown hardware profile {shown_text(name)}; {hint}built-in profiles: {', '.join(known)}. "
        "Run `dsplan hardware` to list them, or pass a path to your own YAML file."
    )


@functools.lru_cache(maxsize=64)
def _load_file_cached(path: str, mtime_ns: int) -> HardwareProfile:
    """Cached on (path, mtime) so an edited file is read again."""
    return load_profile_file(Path(path))


def load_profile_file(path: Path) -> HardwareProfile:
    """Parse and validate one profile YAML file (no cache)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read hardware profile: {err}") from None
    data = _parse_yaml(path, text)
    data.setdefault("name", path.stem)
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: dict[str, Any], source: str = "hardware profile") -> HardwareProfile:
    """Validate plain data as a profile; strict types, so '300' or 'yes' is not a number."""
    try:
        profile = HardwareProfile.model_validate(data, strict=True)
    except ValidationError as err:
        raise UserError(_describe(source, err)) from None
    if not {"bf16", "fp16"} & set(profile.gpu.peak_TFLOPs):
        raise UserError(f"{source}: gpu.peak_TFLOPs needs a bf16 (or fp16) dense rate, the planner's training dtype; "
                        f"{_SCHEMA_HINT}")
    return profile


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last silently)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: keys given here override it
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)

# The same loader over libyaml's C parser, when PyYAML was built with it: ~10x faster
# (1 ms against 9 ms for a built-in profile). Only the parser differs; constructing and
# resolving (so the data, and the duplicate-key rule) stay the Python code above.
_FastUniqueKeyLoader: type | None = None
if getattr(yaml, "__with_libyaml__", False):

    class _FastUniqueKeyLoader(yaml.CSafeLoader):  # type: ignore[no-redef]
        """_UniqueKeyLoader with libyaml's parser."""

    _FastUniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _load_yaml(text: str) -> Any:
    """Parse with the fast loader; on any error, parse again with the Python one, so a broken
    file is described exactly as the Python parser words it (libyaml's messages differ)."""
    if _FastUniqueKeyLoader is not None:
        try:
            return yaml.load(text, Loader=_FastUniqueKeyLoader)  # noqa: S506 - a CSafeLoader subclass
        except yaml.YAMLError:
            pass
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def _parse_yaml(path: Path, text: str) -> dict[str, Any]:
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{path}: malformed YAML{where}: {problem}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise UserError(f"{path}: nested too deeply to read; a hardware profile is nested 3 levels: "
                        f"fix the file ({_SCHEMA_HINT})") from None
    except ValueError:  # an integer of over 4,300 digits: Python's limit on reading one
        digits = re.search(r"\d{4000,}", text)
        where = f" (line {text.count(chr(10), 0, digits.start()) + 1})" if digits else ""
        raise UserError(f"{path}: a number{where} has thousands of digits, more than Python reads; "
                        f"give the field a real value ({_SCHEMA_HINT})") from None
    nesting(data, str(path))
    if data is None:
        raise UserError(f"{path}: the file is empty; {_SCHEMA_HINT}")
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of fields (name, gpu, node, fabric), "
                        f"got {type(data).__name__}; {_SCHEMA_HINT}")
    return data


def _describe(source: str, err: ValidationError) -> str:
    """describe_validation_error plus 'did you mean' for misspelled field names."""
    import difflib  # only for a broken file: off the start-up path

    message = describe_validation_error(source, err)
    hints = []
    for item in err.errors():
        loc = tuple(item.get("loc", ()))
        where = ".".join(map(str, loc))
        if item.get("type") == "less_than_equal":
            why = next(filter(None, (profile_why(str(part)) for part in reversed(loc))), None)
            if why:
                hints.append(f"{where}: the bound is {why}")
        if item.get("type") == "extra_forbidden":
            fields = _fields_at(HardwareProfile, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), fields, n=1, cutoff=0.6)
            if close:
                hints.append(f"{where} -> did you mean {close[0]!r}?")
    if hints:
        message += " (" + "; ".join(hints) + ")"
    return f"{message}; {_SCHEMA_HINT}"


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the nested model reached by following ``loc`` from ``model``."""
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)
