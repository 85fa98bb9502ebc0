"""Reading Hugging Face ``config.json`` values: key aliases, types, defaults, clear errors.

Configs of different families spell the same fact differently (``num_hidden_layers`` /
``n_layer`` / ``num_layers``...). ``ConfigReader`` looks a canonical field up under its
aliases in priority order (reference/models/README.md section 5), checks its type
and sign, records every default it applies (so ``ModelSpec.defaulted`` can show the user
what was guessed), and turns every problem into one ``UserError`` naming the file and key.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from planner.errors import UserError
from planner.limits import MODEL_BOUNDS, nesting, shown

# Canonical field -> accepted keys, in priority order (reference README section 5).
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
HIDDEN = ("hidden_size", "n_embd", "n_embed", "d_model", "dim")
FFN = ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")
HEADS = ("num_attention_heads", "n_head", "n_heads")
KV_HEADS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num")
HEAD_DIM = ("head_dim",)
VOCAB = ("vocab_size",)
MAX_SEQ = ("max_position_embeddings", "n_positions", "seq_length", "max_seq_len")
TIED = ("tie_word_embeddings",)
ROPE_THETA = ("rope_theta", "rotary_emb_base")
ROTARY_PCT = ("partial_rotary_factor", "rotary_pct")
NORM_EPS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon")
MTP = ("num_nextn_predict_layers",)  # DeepSeek-V3's multi-token-prediction depths

REQUIRED: Any = object()  # sentinel default: the key must be present

# What each integer key counts, for its bound (planner/limits.py MODEL_BOUNDS; unlisted: "other").
_WIDTHS = HIDDEN + HEAD_DIM + ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                               "width", "embed_dim", "n_embed", "input_dim")
BOUNDED_AS: dict[str, str] = {
    **dict.fromkeys(LAYERS + MTP + ("layers", "depth", "first_k_dense_replace"), "layers"),
    **dict.fromkeys(_WIDTHS, "width"),
    **dict.fromkeys(FFN + ("moe_intermediate_size", "shared_expert_intermediate_size"), "ffn"),
    **dict.fromkeys(HEADS + KV_HEADS + ("heads", "num_heads"), "heads"),
    **dict.fromkeys(VOCAB, "vocab"),
    **dict.fromkeys(("n_routed_experts", "num_local_experts", "num_experts", "n_shared_experts",
                     "num_experts_per_tok"), "experts"),
    **dict.fromkeys(MAX_SEQ + ("sliding_window",), "positions"),
}


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a config.json into a dict, or raise a UserError naming the file and the problem."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(f"{path}: cannot read the model config ({err.strerror or err})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a UTF-8 text file; give a Hugging Face config.json") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as err:
        raise UserError(
            f"{path}: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}; "
            "fix the file (it must be a Hugging Face config.json)"
        ) from None
    except RecursionError:  # the decoder recurses per level: ~1,000 levels exhaust the stack
        raise UserError(f"{path}: nested too deeply to read; a Hugging Face config.json is nested 3 levels: "
                        "fix the file") from None
    except ValueError as err:  # an integer of over 4,300 digits (Python's limit), or NaN / Infinity
        raise UserError(f"{path}: {_unreadable(text, err)}: fix the file (it must be a Hugging Face config.json)") \
            from None
    nesting(data, str(path))
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object (a Hugging Face config.json), got {type(data).__name__}")
    return data


def _no_constant(name: str) -> Any:
    """NaN, Infinity and -Infinity: Python's json reads them; no config value is one."""
    raise ValueError(f"{name} is not a JSON number")


def _unreadable(text: str, err: ValueError) -> str:
    """What made ``json.loads`` raise a plain ValueError, with the line it is on."""
    found = re.search(r"\d{4000,}", text)
    if found is None:
        return f"{err} (a config's values are finite numbers)"
    return f"a number at line {text.count(chr(10), 0, found.start()) + 1} has {len(found[0]):,} digits, more than " \
           "Python reads"


class ConfigReader:
    """Typed look-ups in one (possibly nested) config dict.

    ``defaulted`` and ``missing`` are shared with nested readers made by ``sub`` so one
    import collects every default and every missing key of the whole file.
    """

    def __init__(self, config: dict[str, Any], source: str, prefix: str = "",
                 defaulted: list[str] | None = None) -> None:
        self.config = config
        self.source = source
        self.prefix = prefix
        self.defaulted: list[str] = [] if defaulted is None else defaulted

    # -- structure --------------------------------------------------------------------
    def has(self, *keys: str) -> bool:
        """True if any key is present (even with a null value)."""
        return any(k in self.config for k in keys)

    def find(self, keys: tuple[str, ...]) -> str | None:
        """The first alias present with a non-null value."""
        return next((k for k in keys if self.config.get(k) is not None), None)

    def sub(self, key: str) -> "ConfigReader":
        """A reader for a nested object (an empty one when the key is absent)."""
        value = self.config.get(key)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            self.fail(key, f"must be a JSON object, got {_kind(value)}")
        return ConfigReader(value, self.source, f"{self.prefix}{key}.", self.defaulted)

    def path(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, problem: str) -> None:
        raise UserError(f"{self.source}: field '{self.path(key)}' {problem}; fix that field in the file")

    def missing_keys(self, required: dict[str, tuple[str, ...]]) -> list[str]:
        """Describe each required canonical field that none of its aliases provide."""
        out = []
        for keys in required.values():
            if self.find(keys) is None:
                names = " / ".join(self.path(k) for k in keys)
                out.append(names)
        return out

    # -- typed values -----------------------------------------------------------------
    def _raw(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        key = self.find(keys)
        if key is not None:
            return key, self.config[key]
        if default is REQUIRED:
            raise UserError(
                f"{self.source}: missing required key {' / '.join(self.path(k) for k in keys)}; "
                "add it to the file"
            )
        name = next((k for k in keys if k in self.config), keys[0])  # e.g. GPT-2's "n_inner": null
        self.defaulted.append(self.path(name))
        return name, default

    def get_int(self, keys: tuple[str, ...] | str, default: Any = REQUIRED, *, minimum: int = 1) -> int:
        """An integer from ``minimum`` to the bound of what the key counts (BOUNDED_AS;
        integral floats such as 4096.0 are accepted)."""
        keys = (keys,) if isinstance(keys, str) else keys
        key, value = self._raw(keys, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be an integer, got {_kind(value)}")
        if isinstance(value, float):
            if not value.is_integer():
                self.fail(key, f"must be an integer, got {value}")
            value = int(value)
        if value < minimum:
            need = "positive" if minimum == 1 else f">= {minimum}"
            self.fail(key, f"must be {need}, got {shown(value)}")
        bound = MODEL_BOUNDS[BOUNDED_AS.get(key, "other")]
        if value > bound.most:
            self.fail(key, f"must be at most {bound.most:,} ({bound.why}), got {shown(value)}")
        return value

    def opt_int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int | None:
        """An optional integer: explicit null (or 0 where allowed) means 'not used'."""
        if key in self.config and self.config[key] is None:
            return None
        if key not in self.config:
            if default is not None:
                self.defaulted.append(self.path(key))
            return default
        return self.get_int(key, minimum=minimum)

    def get_float(self, keys: tuple[str, ...] | str, default: Any = REQUIRED, *, maximum: float | None = None,
                  why: str = "") -> float:
        """A finite number > 0 (and <= ``maximum``, ``why`` saying why)."""
        keys = (keys,) if isinstance(keys, str) else keys
        key, value = self._raw(keys, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, f"must be a number, got {_kind(value)}")
        if not value > 0:
            self.fail(key, f"must be positive, got {shown(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number) or (maximum is not None and number > maximum):
            self.fail(key, f"must be at most {maximum:g}{why}, got {shown(value)}" if maximum is not None
                      else f"must be a finite number, got {shown(value)}")
        return number

    def get_bool(self, keys: tuple[str, ...] | str, default: Any = REQUIRED) -> bool:
        keys = (keys,) if isinstance(keys, str) else keys
        key, value = self._raw(keys, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {_kind(value)}")
        return value

    def get_str(self, keys: tuple[str, ...] | str, default: Any = REQUIRED) -> str:
        keys = (keys,) if isinstance(keys, str) else keys
        key, value = self._raw(keys, default)
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {_kind(value)}")
        return value

    def str_list(self, key: str) -> list[str] | None:
        """A list of strings (None when the key is absent or null)."""
        value = self.config.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(key, f"must be a list of strings, got {_kind(value)}")
        return list(value)

    def int_list(self, key: str) -> list[int]:
        value = self.config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            self.fail(key, f"must be a list of integers, got {_kind(value)}")
        return list(value)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, (list, dict)):
        return f"a JSON {'array' if isinstance(value, list) else 'object'}"
    return f"{type(value).__name__} {value!r}"
