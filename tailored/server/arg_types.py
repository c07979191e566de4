"""The JSON types of each tool's arguments, from the tools' `parameters` JSON Schemas: how the
tool-call parser (tool_calls.py) converts an argument's text (`convert_value`).

    types = param_types(tools)["get_weather"]["days"]   # e.g. {"integer"}

Types come from a schema's `type` (a name or a list), the branches of anyOf / oneOf / allOf,
local `$ref`s ("#", "#/$defs/X", resolved in the parameters schema), and enum / const values
(their JSON types, plus FIXED when any of them is a string). The parameters are those of the
object the `parameters` schema describes, through a `$ref` at its root and its
anyOf / oneOf / allOf branches (pydantic writes a root `$ref` for a self-referencing model);
key OTHER holds the types of additionalProperties, for a name not in `properties`. None found
= {} (the value is read as the text it is).

Bounded work: each `$ref` is resolved once unless its types depend on a cycle back to a schema
still being read (those are read again from each place, so the result does not depend on which
parameter came first), and a walk stops after MAX_NODES schemas or MAX_DEPTH levels (what it did
not read adds no type).

Source: JSON Schema 2020-12 (applicators, `$ref` as a JSON pointer, RFC 6901 escapes); OpenAI's
function `parameters`; vLLM's qwen3_coder parser reads types the same way (from `type` only).
"""

from __future__ import annotations

from typing import Any

# the pseudo-type of a value that may be one of a fixed set of strings (enum / const): read
# whole, not streamed, and stripped unless a grammar held the call (the model may pad an enum
# value it writes freely; a grammar's value is exact: engine/tool_grammar.py)
FIXED = "fixed"
# param_types' key for the parameters a schema's additionalProperties describes
OTHER = ""  # never a parameter name (FunctionDefinition refuses empty names)
MAX_DEPTH = 200  # nested schemas deeper than this read as no type
MAX_NODES = 20000  # schemas read a tool, at most

_VALUE_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                (dict, "object"), (list, "array"), (type(None), "null"))
_BRANCHES = ("anyOf", "oneOf", "allOf")


def param_types(tools: list[dict] | None) -> dict[str, dict[str, set[str]]]:
    """{function name: {parameter name: its JSON types}} from OpenAI `tools` ([{"type":
    "function", "function": {"name", "parameters"}}]); entries that are not such are skipped."""
    out: dict[str, dict[str, set[str]]] = {}
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        walk = _Walk(fn.get("parameters"))
        props: dict[str, list] = {}
        extra: list = []
        walk.objects(walk.root, props, extra, 0)
        types = {k: set().union(*(walk.types(s) for s in subs)) for k, subs in props.items()}
        if extra:
            types[OTHER] = set().union(*(walk.types(s) for s in extra))
        out[fn["name"]] = types
    return out


class _Walk:
    """One tool's parameters schema: its objects' properties and its values' types."""

    def __init__(self, root: Any):
        self.root = root
        self.memo: dict[str, set[str]] = {}  # $ref -> types, for refs read without a cycle
        self.open: set[str] = set()  # $refs being read (a cycle back to one adds nothing)
        self.left = MAX_NODES

    def _cut(self, depth: int) -> bool:
        """Count one schema read; True past a bound (then it is not read)."""
        self.left -= 1
        return depth > MAX_DEPTH or self.left <= 0

    def objects(self, schema: Any, props: dict[str, list], extra: list, depth: int,
                seen: frozenset = frozenset()) -> None:
        """Collect the property schemas (by name) and additionalProperties schemas of the
        object(s) `schema` describes, through `$ref`s and branches."""
        if not isinstance(schema, dict) or self._cut(depth):
            return
        p = schema.get("properties")
        for name, sub in (p.items() if isinstance(p, dict) else ()):
            props.setdefault(name, []).append(sub)
        if isinstance(schema.get("additionalProperties"), dict):
            extra.append(schema["additionalProperties"])
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref not in seen:
            self.objects(resolve(ref, self.root), props, extra, depth + 1, seen | {ref})
        for key in _BRANCHES:
            subs = schema.get(key)
            for sub in subs if isinstance(subs, list) else ():
                self.objects(sub, props, extra, depth + 1, seen)

    def types(self, schema: Any, depth: int = 0) -> set[str]:
        return self._types(schema, depth)[0]

    def _types(self, schema: Any, depth: int) -> tuple[set[str], bool]:
        """(types, complete): complete False when a cycle or a bound cut the reading short
        (then no `$ref` on the way is memoised)."""
        if not isinstance(schema, dict):
            return set(), True  # no schema (e.g. a $ref to nothing): no type, nothing cut
        if self._cut(depth):
            return set(), False
        complete = True
        t = schema.get("type")
        types = {t} if isinstance(t, str) else \
            {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
        ref = schema.get("$ref")
        if isinstance(ref, str):
            if ref in self.memo:
                types |= self.memo[ref]
            elif ref in self.open:
                complete = False
            else:
                self.open.add(ref)
                got, ok = self._types(resolve(ref, self.root), depth + 1)
                self.open.discard(ref)
                if ok:
                    self.memo[ref] = got
                types |= got
                complete &= ok
        for key in _BRANCHES:
            subs = schema.get(key)
            for sub in subs if isinstance(subs, list) else ():
                got, ok = self._types(sub, depth + 1)
                types |= got
                complete &= ok
        values = list(schema["enum"]) if isinstance(schema.get("enum"), list) else []
        if "const" in schema:
            values.append(schema["const"])
        if values:
            if not types:
                types = {next(n for k, n in _VALUE_TYPES if isinstance(v, k)) for v in values}
            if any(isinstance(v, str) for v in values):
                types |= {"string", FIXED}
        return types, complete


def describes_object(params: Any) -> bool:
    """Whether a function's `parameters` schema can only be a JSON object (named arguments, as
    the call format writes them): None (no parameters), or `type` "object" or none, no enum /
    const, and every `$ref` target and anyOf / oneOf / allOf branch the same. A grammar held to
    another schema makes the model write a bare value after `<function=NAME>`."""
    return params is None or _object_only(params, params, frozenset(), 0)


def _object_only(schema: Any, root: Any, seen: frozenset, depth: int) -> bool:
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return False
    if schema.get("type", "object") not in ("object", ["object"]):
        return False
    if "enum" in schema or "const" in schema:
        return False
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in seen:
        if not _object_only(resolve(ref, root), root, seen | {ref}, depth + 1):
            return False
    return all(_object_only(sub, root, seen, depth + 1)
               for key in _BRANCHES for sub in (schema.get(key) or ()))


def resolve(ref: str, root: Any) -> Any:
    """The schema a local JSON pointer ("#", "#/$defs/X", RFC 6901 escapes) names in `root`,
    else None."""
    if ref != "#" and not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
