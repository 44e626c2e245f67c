"""Tool calls through the official `openai` package (run by crates/cli/tests/tool_calls.rs).

The model is a small random checkpoint: what it says means nothing, so the checks are about
shape. A required call is a call, with arguments that parse and fit the tool's schema; the
call and its result go back as history and the server takes them; a named call, streamed,
arrives as `delta.tool_calls` pieces that join into one call.
"""

import argparse
import json
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "now", "parameters": {"type": "object"}},
    },
]

passed, failed = 0, 0


def check(name, fn):
    global passed, failed
    try:
        fn()
        passed += 1
        print(f"ok   {name}")
    except Exception as e:  # noqa: BLE001 - every failure is reported and counted
        failed += 1
        print(f"FAIL {name}: {e!r}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="none")
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    def required_call_then_result():
        r = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=0, max_tokens=120,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = choice.message.tool_calls
        assert calls, choice.message
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_"), call
            arguments = json.loads(call.function.arguments)
            if call.function.name == "get_weather":
                assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("c", "f"), arguments
            else:
                assert call.function.name == "now", call
        history = messages + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C and sunny"},
        ]
        follow = client.chat.completions.create(
            model="m", messages=history, tools=TOOLS, temperature=0, max_tokens=8,
        )
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls"), follow

    def named_call_streamed():
        stream = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0, max_tokens=120, stream=True,
        )
        calls, finish = {}, None
        for chunk in stream:
            choice = chunk.choices[0]
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                if piece.function.name:
                    call["name"] += piece.function.name
                call["arguments"] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
        assert finish == "tool_calls", finish
        assert list(calls) == [0] and calls[0]["name"] == "get_weather", calls
        assert set(json.loads(calls[0]["arguments"])) == {"city", "unit"}, calls

    def none_answers_in_text():
        r = client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, tool_choice="none",
            temperature=0, max_tokens=6,
        )
        assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length", r

    check("required call, then its result as history", required_call_then_result)
    check("named call, streamed", named_call_streamed)
    check("tool_choice none answers in text", none_answers_in_text)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
