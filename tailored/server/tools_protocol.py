"""Function tools in a request: OpenAI's `tools` entries ({"type": "function", "function":
{"name", "description", "parameters"}}) and `tool_choice`, checked so that the model can write
a call of each in Qwen3.6's tool-call XML (tool_calls.py) and a forced tool_choice can be held
to that format by a grammar (engine/grammar.py). Shared by every dialect that takes tools
(Chat Completions, Responses, Messages: each translates its own tool shape to these)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from tailored.server.arg_types import describes_object
from tailored.server.errors import OpenAIError, shown
from tailored.server.protocol import REQUEST_CONFIG
# a longer function or parameter name is not parsed as a call (tool_calls._tag_name)
from tailored.server.tool_calls import MAX_NAME_CHARS as MAX_TOOL_NAME_CHARS

def tool_name_error(name: str) -> str | None:
    """Why a function name cannot be a tool's (None: it can). The model writes a call as
    <function=NAME> and the template renders history calls so: a name ends at the first '>'."""
    if (not name or len(name) > MAX_TOOL_NAME_CHARS
            or any(c in "<>" or c.isspace() or not c.isprintable() for c in name)):
        return (f"must be 1 to {MAX_TOOL_NAME_CHARS} characters without whitespace, '<' or '>' "
                f"(got {shown(name)})")
    return None


class FunctionDefinition(BaseModel):
    """A tool's function: {"name", "description"?, "parameters"? (a JSON schema), "strict"?};
    other fields pass to the chat template as given."""

    model_config = REQUEST_CONFIG

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_fits_the_format(cls, v: str) -> str:
        if (bad := tool_name_error(v)) is not None:
            raise ValueError(bad)
        return v

    @field_validator("parameters")
    @classmethod
    def _parameter_names_fit_the_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # the model writes each argument as <parameter=NAME>: a name ends at the first '>'
        props = v.get("properties") if v else None
        for name in props if isinstance(props, dict) else ():
            if not name or any(c in "<>\r\n" for c in name) or len(name) > MAX_TOOL_NAME_CHARS:
                raise ValueError(
                    f"property {shown(name)} cannot be written as <parameter=NAME> (1 to "
                    f"{MAX_TOOL_NAME_CHARS} characters without '<', '>' or a line break)"
                )
        return v


class ChatTool(BaseModel):
    """One entry of `tools`: {"type": "function", "function": FunctionDefinition}."""

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


# tool_choice values served: "auto" (the model decides), "none" (no tools in the prompt,
# nothing parsed, as vLLM's default), and the forced ones, held to the tool-call XML by a
# grammar (engine/grammar.py, StructuredOutput "tool_calls"): "required" (one or more calls)
# and {"type": "function", "function": {"name": NAME}} (one call of NAME)
TOOL_CHOICES = (None, "auto", "none")


def check_forced_tool_choice(tools: list[ChatTool] | None, choice: Any) -> None:
    """tool_choice "required" or a named function: valid only with tools (OpenAI's rules),
    the name one of theirs, each name once, and each callable function's parameters an
    object. Raises OpenAIError (400) naming the field."""
    if choice == "required":
        name = None
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str) and len(choice) == 2
          and len(choice["function"]) == 1):
        name = choice["function"]["name"]
    else:
        raise OpenAIError(
            f"tool_choice {shown(choice)} is not valid: 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not tools:
        raise OpenAIError(f"tool_choice {shown(choice)} needs tools", param="tool_choice")
    names = [t.function.name for t in tools]
    for i, n in enumerate(names):
        if n in names[:i]:  # the grammar names each function once
            raise OpenAIError(f"tools[{i}].function.name {shown(n)} is given twice",
                              param=f"tools[{i}].function.name")
    if name is not None and name not in names:
        raise OpenAIError(f"tool_choice names the function {shown(name)}, which is not "
                          "among tools", param="tool_choice")
    for i, tool in enumerate(tools):
        if (name is None or tool.function.name == name) and \
                not describes_object(tool.function.parameters):
            raise OpenAIError(
                "a forced tool call needs each function's parameters to describe an object "
                "(type 'object': named arguments)", param=f"tools[{i}].function.parameters")
