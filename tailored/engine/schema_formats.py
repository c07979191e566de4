"""String `format`s held exactly: a JSON Schema's `format` rewritten as the `pattern` of exactly
the strings a validator accepts, before xgrammar compiles the schema.

xgrammar 0.2.9's own format grammars are looser than the formats they name, so an answer (or
a forced tool call's argument) that follows the grammar could still fail the client's
validation (jsonschema's format checker, pydantic): `date` allowed any day 01-31 in every month
("1934-02-30"), `time` and `date-time` a 60th second and any offset hour, `ipv4` leading
zeros ("075.222.57.35"), which Python's `ipaddress` (and so jsonschema) refuses. The
patterns here accept exactly the values of RFC 3339 that Python's `datetime` can hold
(years 0001-9999, the Gregorian leap years, seconds 00-59, offsets up to 23:59) and
dotted-quad IPv4 without leading zeros. Other formats are left to xgrammar.

A string schema with its own `pattern`, `minLength` or `maxLength` keeps its `format` as it is
(xgrammar takes no pattern beside a length bound, and a pattern already says what it wants).
"""

from __future__ import annotations

from typing import Any

# keywords that hold subschemas (walked); anything else is a value (enum, const, examples,
# vendor extensions): never rewritten
SCHEMA_MAPS = ("properties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties")

_YEAR = r"(?:[1-9]\d{3}|0[1-9]\d{2}|00[1-9]\d|000[1-9])"  # 0001-9999 (datetime's range)
# a day that exists: 31-day months, 30-day months, February to the 28th, and the 29th of
# February of a leap year (divisible by 4, and by 400 for a century; year 0000 excluded)
_DATE = (r"(?:" + _YEAR + r"-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|02-(?:0[1-9]|1\d|2[0-8]))"
         r"|(?:\d\d(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
         r"-02-29)")
# (the optional fraction as an alternative with an empty branch: xgrammar 0.2.9 compiles an
# optional group holding a counted repeat, "(\.\d{1,9})?", into one that lets the dot out)
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,9}|)(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]\d|\d)"

FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
}


def exact_formats(schema: Any) -> Any:
    """`schema` (a JSON Schema as Python values) with every `format` of FORMAT_PATTERNS
    written as its exact `pattern` (see the module docstring); a new value where something
    changed, the same objects elsewhere."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    fmt = out.get("format")
    if (isinstance(fmt, str) and fmt in FORMAT_PATTERNS
            and not {"pattern", "minLength", "maxLength"} & out.keys()):
        del out["format"]
        out["pattern"] = FORMAT_PATTERNS[fmt]
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: exact_formats(v) for k, v in out[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [exact_formats(v) for v in out[key]]
    for key in SCHEMA_ONE:
        if key in out:
            out[key] = exact_formats(out[key])
    return out
