"""calibration.yaml: the factors ``dsplan calibrate`` fitted for one system, read and written.

    system: dgx-a100-80g          # the hardware profile's name the runs ran on
    calibration:                  # planner.hardware.profile.Calibration, as in a profile
      gemm: 0.7
      hbm: 1.0
      network: 0.5
      overlap: 1.0
      fitted_on: [run-a, run-b]
    runs: [...]                   # informational: each run's measured and predicted step time

Applied with ``--calibration FILE`` (``planner.api.with_calibration``), the section replaces the
hardware profile's own; a file fitted on another system is refused. Every problem is one
UserError naming the file and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from planner.errors import UserError, arg, describe_validation_error
from planner.hardware.load import _load_yaml
from planner.hardware.profile import Calibration, HardwareProfile
from planner.limits import nesting, path_kind, shown_path

KEYS = ("system", "calibration", "runs")
_FIX = "write it with `dsplan calibrate` (hardware_profiles/README.md, calibration)"


@dataclass(frozen=True)
class CalibrationFile:
    system: str
    calibration: Calibration
    source: str


def read_calibration(path: str | Path) -> CalibrationFile:
    """Parse and check one calibration.yaml."""
    where = f"{arg('calibration')} {shown_path(str(path))}"
    file = Path(path).expanduser()
    kind = path_kind(file)
    if kind is None:
        raise UserError(f"{where}: no such file; {_FIX}")
    if kind != "file":
        raise UserError(f"{where}: not a file; give the calibration.yaml `dsplan calibrate` wrote")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{where}: cannot read it ({err.__class__.__name__}: {err})") from None
    data = _parse(where, text)
    unknown = sorted(set(map(str, data)) - set(KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key(s) {', '.join(unknown)}; a calibration file has {', '.join(KEYS)}")
    system = data.get("system")
    if not isinstance(system, str) or not system.strip():
        raise UserError(f"{where}: needs system: the hardware profile's name the runs ran on; {_FIX}")
    section = data.get("calibration")
    if not isinstance(section, dict):
        raise UserError(f"{where}: needs a calibration: mapping (gemm, hbm, network, overlap); {_FIX}")
    extra = sorted(set(map(str, section)) - set(Calibration.model_fields))
    if extra:
        raise UserError(f"{where}: calibration: unknown key(s) {', '.join(extra)}; it has "
                        f"{', '.join(Calibration.model_fields)}")
    try:
        calibration = Calibration.model_validate(section, strict=True)
    except ValidationError as err:
        raise UserError(f"{describe_validation_error(f'{where}: calibration', err)}; the factors are 0.01 to 100, "
                        f"overlap 0 to 1 (hardware_profiles/README.md)") from None
    if "runs" in data and not isinstance(data["runs"], list):
        raise UserError(f"{where}: runs: expected a list (what the factors were fitted on), "
                        f"got {type(data['runs']).__name__}")
    return CalibrationFile(system.strip(), calibration, str(path))


def _parse(where: str, text: str) -> dict[str, Any]:
    try:
        data = _load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UserError(f"{where}: malformed YAML{at}: {problem}") from None
    except (RecursionError, ValueError):
        raise UserError(f"{where}: not a calibration file (nested too deeply, or a number too long to read); "
                        f"{_FIX}") from None
    nesting(data, where)
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping with system and calibration, got "
                        f"{'an empty file' if data is None else type(data).__name__}; {_FIX}")
    return data


def with_calibration(profile: HardwareProfile, calibration: "str | Path | CalibrationFile") -> HardwareProfile:
    """``profile`` with its calibration section replaced by the file's; a file fitted on another
    system is refused (one message naming the file, both systems and the fix)."""
    cal = calibration if isinstance(calibration, CalibrationFile) else read_calibration(calibration)
    if cal.system != profile.name:
        raise UserError(f"{arg('calibration')} {shown_path(cal.source)}: fitted on system {cal.system}, but the "
                        f"plan is for {profile.name}; calibrate on runs of {profile.name} (`dsplan calibrate`), "
                        f"or plan with {arg('hardware')} {cal.system}")
    return profile.model_copy(update={"calibration": cal.calibration})

