"""Golden vectors for the Responses-to-chat conversion, made by vLLM's own code (run with a
vLLM venv's Python; `cargo xtask vectors` does):

    python responses_vectors.py > vectors/responses.json

Keys keep the order vLLM gives them: a template that prints tools prints them in it.

Each case is a Responses request body (and, for `previous_response_id`, the previous
response's conversation and output), validated by vLLM's `ResponsesRequest` and converted
by vLLM's `construct_input_messages` and `construct_tool_dicts`: the chat messages and
tools vLLM's chat template receives. Both the filter's conversion (core) and the
emulator's are tested against them.
"""

import json
import sys

import vllm
from openai.types.responses import ResponseOutputMessage
from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
from vllm.entrypoints.openai.responses.utils import (
    construct_input_messages,
    construct_tool_dicts,
)


def text(role, *parts, kind="input_text"):
    return {"type": "message", "role": role, "content": [{"type": kind, "text": p} for p in parts]}


def output_message(text_):
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text_, "annotations": []}],
    }


CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q":"x"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}

CASES = [
    ("a string input", {"input": "hello"}, None),
    ("instructions then a string", {"instructions": "be brief", "input": "hi"}, None),
    ("an easy message with a string", {"input": [{"role": "user", "content": "plain"}]}, None),
    ("input_text parts", {"input": [text("user", "one", "two")]}, None),
    ("a developer message", {"input": [text("developer", "rules"), text("user", "q")]}, None),
    (
        "an assistant output message",
        {"input": [text("user", "q"), output_message("a"), text("user", "again")]},
        None,
    ),
    (
        "an assistant easy message with parts",
        {"input": [text("user", "q"), text("assistant", "first", "second", kind="output_text")]},
        None,
    ),
    (
        "reasoning, a call and its output",
        {
            "input": [
                text("user", "q"),
                {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
                CALL,
                OUTPUT,
            ]
        },
        None,
    ),
    (
        "reasoning from its summary",
        {
            "input": [
                text("user", "q"),
                {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "short"}]},
                output_message("done"),
            ]
        },
        None,
    ),
    (
        "two calls merge into one assistant turn",
        {"input": [text("user", "q"), CALL, dict(CALL, call_id="call_2", name="other"), OUTPUT]},
        None,
    ),
    (
        "a call after an assistant text",
        {"input": [text("user", "q"), output_message("let me look"), CALL, OUTPUT]},
        None,
    ),
    (
        "a namespaced call",
        {"input": [text("user", "q"), dict(CALL, namespace="tools"), OUTPUT]},
        None,
    ),
    (
        "a custom tool call",
        {
            "input": [
                text("user", "q"),
                {"type": "custom_tool_call", "call_id": "call_3", "name": "shell", "input": "ls -l"},
                {"type": "custom_tool_call_output", "call_id": "call_3", "output": "total 0"},
            ]
        },
        None,
    ),
    (
        "function, namespace, custom and hosted tools",
        {
            "input": "use a tool",
            "tools": [
                {"type": "function", "name": "lookup", "description": "find", "parameters": {"type": "object", "properties": {}}},
                {"type": "function", "name": "bare"},
                {"type": "web_search"},
                {
                    "type": "namespace",
                    "name": "crm",
                    "description": "the crm",
                    "tools": [{"type": "function", "name": "find", "parameters": {"type": "object"}}],
                },
                {"type": "custom", "name": "shell", "description": "run"},
            ],
        },
        None,
    ),
    (
        "a previous response continued",
        {"instructions": "new rules", "input": "and then?"},
        {
            "messages": [
                {"role": "system", "content": "old rules"},
                {"role": "user", "content": "first"},
            ],
            "output": [
                {"id": "rs_9", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hidden"}]},
                output_message("first answer"),
            ],
        },
    ),
]


def plain(value):
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    raise TypeError(f"cannot encode {type(value)}")


def main():
    vectors = []
    for name, body, previous in CASES:
        request = ResponsesRequest.model_validate(dict(body, model="m"))
        prev_msg = prev_output = None
        if previous is not None:
            prev_msg = previous["messages"]
            prev_output = [
                ResponseOutputMessage.model_validate(item)
                for item in previous["output"]
                if item["type"] == "message"
            ]
        messages = construct_input_messages(
            request_instructions=request.instructions,
            request_input=request.input,
            prev_msg=prev_msg,
            prev_response_output=prev_output,
        )
        messages = json.loads(json.dumps(messages, default=plain))
        tools = construct_tool_dicts(request.tools, request.tool_choice)
        vectors.append(
            {"name": name, "body": body, "previous": previous, "messages": messages, "tools": tools}
        )
    json.dump({"vllm": vllm.__version__, "cases": vectors}, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
