"""The structured-output request fields: OpenAI's `response_format` ("text", "json_object",
"json_schema") and vLLM's `structured_outputs` (json, json_object, regex, choice, grammar),
each turned into the engine's `StructuredOutput` (engine/grammar.py enforces it)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tailored.engine.types import StructuredOutput
from tailored.server.errors import OpenAIError

# response_format's JSON Schema (compact JSON text), a regex or a grammar: parsed on the
# engine's thread (~0.1 s at most for a schema this size), so its size is bounded; the time a
# grammar takes to compile or mask is bounded by the engine (COMPILE_TIMEOUT_S, MASK_LIMIT_S)
MAX_SCHEMA_CHARS = 65536


def _check_schema_size(text: str, what: str, param: str) -> None:
    """OpenAIError (400) for a schema over MAX_SCHEMA_CHARS characters of JSON text."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise OpenAIError(f"{what} may have at most {MAX_SCHEMA_CHARS} characters as JSON, "
                          f"got {len(text)}", param=param)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` (OpenAI): the schema the answer must follow. `name`,
    `description` and `strict` are accepted and change nothing: the schema is always enforced
    (xgrammar's strict mode: no properties beyond the schema's)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (JSON that follows `json_schema.schema`); engine/grammar.py enforces it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema' and only then")
        return self

    def structured(self) -> StructuredOutput | None:
        """The engine's record; raises OpenAIError for a schema over MAX_SCHEMA_CHARS."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        text = json.dumps(self.json_schema.json_schema, separators=(",", ":"))
        _check_schema_size(text, "response_format's schema", "response_format")
        return StructuredOutput("json_schema", text)


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field (its `StructuredOutputsParams`): exactly one of
    `json` (a JSON Schema, object or JSON text), `json_object` (true), `regex`, `choice` (a
    list of strings), `grammar` (EBNF, xgrammar's dialect). `disable_any_whitespace`: JSON
    without free whitespace (xgrammar's compact separators); vLLM's other fields
    (`whitespace_pattern`, ...) are accepted and change nothing; `structural_tag` is
    refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    structural_tag: Any = None
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        if self.structural_tag is not None:
            raise ValueError("'structural_tag' is not supported by this server")
        kinds = [k for k in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("exactly one of 'json', 'json_object', 'regex', 'choice', "
                             "'grammar' must be set")
        return self

    def structured(self) -> StructuredOutput:
        """The engine's record; raises OpenAIError for a schema over MAX_SCHEMA_CHARS."""
        compact = self.disable_any_whitespace
        if self.json_object:
            return StructuredOutput("json_object", compact=compact)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        if self.choice is not None:
            text = json.dumps(self.choice)
            kind = "choice"
        else:
            text = (self.json_ if isinstance(self.json_, str)
                    else json.dumps(self.json_, separators=(",", ":")))
            kind = "json_schema"
        _check_schema_size(text, "structured_outputs", "structured_outputs")
        return StructuredOutput(kind, text, compact=compact and kind == "json_schema")

