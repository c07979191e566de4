"""Chat template (model spec §10.3): generation prompt, thinking, tools, content parts."""

from __future__ import annotations

import json

import pytest

from tailored.tokenizer import CHAT_TEMPLATE, ChatTemplateError, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


USER_HELLO = [{"role": "user", "content": "Hello"}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a <city> & day",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_hello_thinking_off_ids(tok):
    p = tok.apply_chat_template(USER_HELLO, enable_thinking=False)
    assert p == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.encode(p) == [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198,
                             248068, 271, 248069, 271]


def test_thinking_on_by_default(tok):
    p = tok.apply_chat_template(USER_HELLO)
    assert p == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert tok.apply_chat_template(USER_HELLO, add_generation_prompt=False) == (
        "<|im_start|>user\nHello<|im_end|>\n")


def test_system_message(tok):
    msgs = [{"role": "system", "content": "Be brief."}] + USER_HELLO
    assert tok.apply_chat_template(msgs, enable_thinking=False).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n")
    with pytest.raises(ChatTemplateError, match="only allowed first"):
        tok.apply_chat_template(USER_HELLO + [{"role": "system", "content": "late"}])
    assert issubclass(ChatTemplateError, ValueError)


def test_multi_part_content(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo"}]}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(USER_HELLO)
    none_content = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n<|im_end|>" in tok.apply_chat_template(
        none_content, add_generation_prompt=False)


@pytest.mark.parametrize("content, kind", [
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "image_url"),
    ([{"type": "text", "text": "a"}, {"type": "input_audio"}], "input_audio"),
    ([{"text": "no type"}], "None"),
    (["bare string part"], "str"),
])
def test_bad_content_parts_raise(tok, content, kind):
    with pytest.raises(ValueError, match=kind):
        tok.apply_chat_template([{"role": "user", "content": content}])
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": {"type": "text", "text": "x"}}])


def test_tools_block(tok):
    msgs = [{"role": "system", "content": "You are helpful."}] + USER_HELLO
    p = tok.apply_chat_template(msgs, tools=[WEATHER_TOOL])
    head = ("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n"
            "<tools>\n" + json.dumps(WEATHER_TOOL, ensure_ascii=False) + "\n</tools>")
    assert p.startswith(head)
    assert "<city> & day" in p  # tojson does not HTML-escape
    assert "\n\nYou are helpful.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n" in p
    assert p.count("<|im_start|>system") == 1
    assert p.endswith("<|im_start|>assistant\n<think>\n")


def test_tool_calls_and_results(tok):
    msgs = USER_HELLO + [
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Oslo", "opts": [1]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "rain"}]},
    ]
    p = tok.apply_chat_template(msgs, tools=[WEATHER_TOOL], enable_thinking=False)
    assert ("<|im_start|>assistant\n<think>\n\n</think>\n\nChecking.\n\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=opts>\n[1]\n</parameter>\n</function>\n</tool_call><|im_end|>\n") in p
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n") in p
    with pytest.raises(ValueError, match="JSON"):
        tok.apply_chat_template(USER_HELLO + [{"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "f", "arguments": "{not json"}}]}])
    # the caller's messages are not modified
    assert isinstance(msgs[1]["tool_calls"][0]["function"]["arguments"], str)


def test_reasoning_history(tok):
    msgs = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "new thoughts"},
    ]
    p = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in p  # before the last query: dropped
    assert "old thoughts" not in p
    assert "<|im_start|>assistant\n<think>\nnew thoughts\n</think>\n\nA2<|im_end|>\n" in p
    kept = tok.apply_chat_template(msgs, add_generation_prompt=False, preserve_thinking=True)
    assert "<|im_start|>assistant\n<think>\nold thoughts\n</think>\n\nA1<|im_end|>\n" in kept


def test_template_from_tokenizer_config(tmp_path):
    cfg = {"chat_template": [
        {"name": "default", "template": "D{% for m in messages %}[{{ m.content }}]{% endfor %}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{{ tools[0] | tojson }}"},
    ]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template(USER_HELLO) == "D[Hello]"
    assert t.apply_chat_template(USER_HELLO, tools=[{"a": "<b>"}]) == 'T1{"a": "<b>"}'


def test_template_from_jinja_file_and_raise_exception(tmp_path):
    (tmp_path / "chat_template.jinja").write_text(
        "{% if enable_thinking %}{{ raise_exception('thinking on: ' + messages[0].role) }}"
        "{% endif %}ok")
    t = load_tokenizer(tmp_path)
    assert t.apply_chat_template(USER_HELLO, enable_thinking=False) == "ok"
    with pytest.raises(ChatTemplateError, match="thinking on: user"):
        t.apply_chat_template(USER_HELLO)


def test_sandbox(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages.__class__.__mro__ }}"}))
    with pytest.raises(ChatTemplateError):
        load_tokenizer(tmp_path).apply_chat_template(USER_HELLO)


def test_matches_transformers_renderer(tok):
    """Our jinja environment renders the built-in template exactly as transformers does."""
    ctu = pytest.importorskip("transformers.utils.chat_template_utils")
    convs = [
        (USER_HELLO, None, {}),
        ([{"role": "system", "content": "S"}] + USER_HELLO, [WEATHER_TOOL], {}),
        ([{"role": "user", "content": "Q"},
          {"role": "assistant", "content": "x", "reasoning_content": "r",
           "tool_calls": [{"function": {"name": "f", "arguments": {"a": {"b": 1}, "c": "d"}}}]},
          {"role": "tool", "content": "out"}], None, {"enable_thinking": False}),
        ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
          {"role": "user", "content": "Q2"}], None, {"preserve_thinking": True}),
    ]
    for msgs, tools, kw in convs:
        kw = {"enable_thinking": True, **kw}
        ours = tok.apply_chat_template(msgs, tools=tools, **kw)
        theirs = ctu.render_jinja_template([msgs], tools=tools, chat_template=CHAT_TEMPLATE,
                                           add_generation_prompt=True, **kw)
        if isinstance(theirs, tuple):
            theirs = theirs[0]
        if isinstance(theirs, list):
            theirs = theirs[0]
        assert ours == theirs
