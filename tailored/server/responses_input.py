"""The Responses API's request as chat pieces (responses_api.py runs them): the input items
as chat messages (`add_items`, into a conversation.ChatBuilder), the tools as chat tools with
the names the model sees (`ToolNames`), `text.format` as response_format, `tool_choice`. Each
error names the request's own field (`input[3].content[0]`, `tools[2].tools[0].name`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tailored.server.conversation import ChatBuilder, unseal
from tailored.server.errors import OpenAIError, shown
from tailored.server.responses_protocol import HOSTED_TOOL_TYPES
from tailored.server.tools_protocol import tool_name_error

TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image", "file")
# sampling extensions (vLLM's; chat's logit_bias) that pass through to the chat request as
# they are
PASSED_THROUGH = ("top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "stop", "logit_bias")
_CHAT_TOOL_PARAM = re.compile(r"tools\[(\d+)\]\.function")


class ToolNames:
    """The request's function tools as chat tools, and the names the model sees for them:
    `(namespace, name)` <-> model name (`namespace.name` only where two share a name)."""

    def __init__(self, tools: list[Any] | None) -> None:
        self.chat: list[dict[str, Any]] = []  # the chat request's tools
        self.origin: list[str] = []  # each chat tool's field in the request (errors)
        self._to_model: dict[tuple[str | None, str], str] = {}
        self._from_model: dict[str, tuple[str | None, str]] = {}
        found: list[tuple[str | None, dict[str, Any], str]] = []
        for i, tool in enumerate(tools or ()):
            where = f"tools[{i}]"
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind == "function":
                found.append((None, tool, where))
            elif kind == "namespace":
                ns = tool.get("name")
                if not isinstance(ns, str) or not ns or (bad := tool_name_error(ns)):
                    raise OpenAIError(f"invalid '{where}.name': must be a namespace name "
                                      f"{bad or ''}".rstrip(), param=f"{where}.name")
                inner = tool.get("tools")
                if not isinstance(inner, list):
                    raise OpenAIError(f"invalid '{where}.tools': must be a list of function "
                                      "tools", param=f"{where}.tools")
                for j, t in enumerate(inner):
                    if not isinstance(t, dict) or t.get("type") != "function":
                        got = t.get("type") if isinstance(t, dict) else t
                        raise OpenAIError(
                            f"invalid '{where}.tools[{j}]': only function tools are served "
                            f"in a namespace (got {shown(got)})",
                            param=f"{where}.tools[{j}].type")
                    found.append((ns, t, f"{where}.tools[{j}]"))
            elif kind in HOSTED_TOOL_TYPES:
                continue  # run by OpenAI, not here: left out of the prompt
            elif kind == "custom":
                raise OpenAIError(
                    f"'{where}': custom (freeform) tools are not supported by this server; "
                    "declare it as a function tool with JSON parameters", param=f"{where}.type",
                    code="unsupported_parameter")
            else:
                raise OpenAIError(f"invalid '{where}.type': {shown(kind)} is not a tool type "
                                  "this server serves ('function', 'namespace')",
                                  param=f"{where}.type")
        counts: dict[str, int] = {}
        for _, t, _ in found:
            counts[t.get("name")] = counts.get(t.get("name"), 0) + 1
        for ns, t, where in found:
            name = t.get("name")
            if not isinstance(name, str) or (bad := tool_name_error(name)) is not None:
                raise OpenAIError(f"invalid '{where}.name': {bad or 'must be a string'}",
                                  param=f"{where}.name")
            model = f"{ns}.{name}" if ns is not None and counts[name] > 1 else name
            self._to_model[(ns, name)] = model
            self._from_model[model] = (ns, name)
            fn = {"name": model}
            for key in ("description", "parameters", "strict"):
                if t.get(key) is not None:
                    fn[key] = t[key]
            self.chat.append({"type": "function", "function": fn})
            self.origin.append(where)

    def model_name(self, name: str, namespace: str | None = None) -> str:
        """The name the model knows a function by (history calls, tool_choice)."""
        return self._to_model.get((namespace, name), name)

    def item_fields(self, model_name: str | None) -> dict[str, Any]:
        """A call's `name` (and `namespace`) in a function_call item."""
        ns, name = self._from_model.get(model_name or "", (None, model_name))
        return {"name": name, "namespace": ns} if ns is not None else {"name": name}


def _text_of(content: Any, where: str) -> str:
    """The text of a message's content (a string or parts); media parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"invalid '{where}': must be a string or a list of content parts "
                          f"(got {shown(content)})", param=where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        elif kind in MEDIA_PARTS:
            raise OpenAIError(f"'{where}[{j}]': {kind} parts are not supported: this server "
                              "serves a text-only model", param=f"{where}[{j}]",
                              code="unsupported_content")
        else:
            raise OpenAIError(f"invalid '{where}[{j}]': expected a text part with a string "
                              f"'text' (got {shown(part)})", param=f"{where}[{j}]")
    return "".join(out)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"invalid '{where}.{key}': must be a string (got {shown(value)})",
                          param=f"{where}.{key}")
    return value


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its sealed
    encrypted_content, else its summary."""
    parts = item.get("content")
    if isinstance(parts, list):
        text = "".join(p["text"] for p in parts
                       if isinstance(p, dict) and isinstance(p.get("text"), str))
        if text:
            return text
    sealed = unseal(item.get("encrypted_content"))
    if sealed is not None:
        return sealed
    summary = item.get("summary")
    if isinstance(summary, list):
        return "\n\n".join(p["text"] for p in summary
                           if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def add_items(builder: ChatBuilder, items: list[Any], param: str, tools: ToolNames) -> None:
    """Input items into chat messages (see the module docstring); errors name `param[i]`."""
    for i, item in enumerate(items):
        where = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"invalid '{where}': must be an object (got {shown(item)})",
                              param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            text = _text_of(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                builder.system(text)
            elif role == "user":
                builder.user(text)
            elif role == "assistant":
                builder.assistant_text(text)
            else:
                raise OpenAIError(f"invalid '{where}.role': {shown(role)} (one of user, "
                                  "assistant, system, developer)", param=f"{where}.role")
        elif kind == "function_call":
            args = _string(item, "arguments", where)
            try:
                ok = isinstance(json.loads(args), dict) if args.strip() else True
            except (ValueError, RecursionError):
                ok = False
            if not ok:
                raise OpenAIError(f"invalid '{where}.arguments': must be a JSON object as text",
                                  param=f"{where}.arguments")
            ns = item.get("namespace") if isinstance(item.get("namespace"), str) else None
            builder.tool_call(_string(item, "call_id", where),
                              tools.model_name(_string(item, "name", where), ns), args)
        elif kind == "function_call_output":
            builder.tool_result(_string(item, "call_id", where),
                                _text_of(item.get("output"), f"{where}.output"))
        elif kind == "reasoning":
            text = _reasoning_text(item)
            if text:
                builder.reasoning(text)
        else:
            raise OpenAIError(
                f"invalid '{where}.type': {shown(kind)} is not an input item this server "
                "serves (message, function_call, function_call_output, reasoning)",
                param=f"{where}.type")


def response_format(fmt: dict | None) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise OpenAIError("invalid 'text.format.schema': a json_schema format needs a "
                              "JSON Schema object", param="text.format.schema")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        for key in ("strict", "description"):
            if fmt.get(key) is not None:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}
    raise OpenAIError(f"invalid 'text.format.type': {shown(fmt.get('type'))} (one of text, "
                      "json_object, json_schema)", param="text.format.type")


def tool_choice(choice: Any, tools: ToolNames) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance(choice.get("name"), str):
        ns = choice.get("namespace") if isinstance(choice.get("namespace"), str) else None
        return {"type": "function", "function": {"name": tools.model_name(choice["name"], ns)}}
    raise OpenAIError(f"tool_choice {shown(choice)} is not served: 'auto', 'none', 'required' "
                      "or {\"type\": \"function\", \"name\": ...}", param="tool_choice")


def in_request_terms(err: OpenAIError, tools: ToolNames) -> OpenAIError:
    """A chat validation error about tools[k].function... named by the request's field."""
    m = _CHAT_TOOL_PARAM.match(err.param or "")
    if m and int(m.group(1)) < len(tools.origin):
        where = tools.origin[int(m.group(1))]
        err.param = where + err.param[m.end():]
        err.message = err.message.replace(m.group(0), where)
    return err
