"""The Qwen3.6 tool-call markup (model spec §10.3): the tags a call is written in.

One home for them because two layers read them: the engine's forced-call grammar
(engine/grammar.py) and the server's parser of the answer text (server/tool_calls.py).
"""

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAM_START = "<parameter="
PARAM_END = "</parameter>"
# texts that end a parameter value (engine/grammar.py keeps them out of forced calls' strings)
VALUE_ENDS = (PARAM_END, PARAM_START, FUNCTION_END, TOOL_END)
