#!/usr/bin/env python3
"""Talks to a running `ember serve` through the official `openai` package.

Usage: python3 tests/openai_client.py --base-url http://127.0.0.1:PORT/v1 --api-key KEY

Prints one line per check and `N passed, 0 failed` at the end; exits non-zero if any check
fails. Run by crates/cli/tests/openai_python.rs against a server it starts.
"""

import argparse
import sys
import traceback

import openai


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8026/v1")
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default="ember-test", help="any name; the server echoes its own")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=60)
    model = args.model
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    results = {"passed": 0, "failed": 0}

    def check(name, fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - report every failure and keep going
            results["failed"] += 1
            print(f"FAIL {name}")
            traceback.print_exc()
        else:
            results["passed"] += 1
            print(f"ok   {name}")

    def models():
        listed = client.models.list()
        ids = [m.id for m in listed.data]
        assert len(ids) == 1, ids

    def chat():
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            max_tokens=8,
            **greedy,
        )
        assert response.object == "chat.completion", response
        assert response.id.startswith("chatcmpl-"), response.id
        choice = response.choices[0]
        assert choice.message.role == "assistant", choice
        assert isinstance(choice.message.content, str), choice
        assert choice.finish_reason == "length", choice.finish_reason
        assert response.usage.completion_tokens == 8, response.usage
        assert response.usage.total_tokens == response.usage.prompt_tokens + 8, response.usage
        return choice.message.content

    whole_chat = {}

    def chat_once():
        whole_chat["content"] = chat()

    def chat_stream():
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            **greedy,
        )
        parts, finish, usage, roles = [], None, None, []
        for chunk in stream:
            assert chunk.object == "chat.completion.chunk", chunk
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                if choice.delta.content:
                    parts.append(choice.delta.content)
                if choice.finish_reason:
                    finish = choice.finish_reason
        assert roles[:1] == ["assistant"], roles
        assert finish == "length", finish
        assert usage is not None and usage.completion_tokens == 8, usage
        if "content" in whole_chat:
            assert "".join(parts) == whole_chat["content"], ("".join(parts), whole_chat["content"])

    whole_completion = {}

    def completion():
        response = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, **greedy)
        assert response.object == "text_completion", response
        assert response.id.startswith("cmpl-"), response.id
        assert len(response.choices) == 1, response.choices
        assert response.choices[0].finish_reason == "length", response.choices[0]
        assert response.usage.completion_tokens == 8, response.usage
        whole_completion["text"] = response.choices[0].text

    def completion_stream():
        stream = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=8, stream=True, **greedy
        )
        parts, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                parts.append(choice.text or "")
                if choice.finish_reason:
                    finish = choice.finish_reason
        assert finish == "length", finish
        if "text" in whole_completion:
            assert "".join(parts) == whole_completion["text"], ("".join(parts), whole_completion["text"])

    def n_is_rejected():
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
            )
        except openai.BadRequestError as e:
            assert e.status_code == 400, e.status_code
            assert "n" in str(e), str(e)
        else:
            raise AssertionError("n=2 did not raise openai.BadRequestError")

    def wrong_key_is_rejected():
        bad = openai.OpenAI(base_url=args.base_url, api_key=args.api_key + "-wrong", max_retries=0, timeout=60)
        try:
            bad.models.list()
        except openai.AuthenticationError as e:
            assert e.status_code == 401, e.status_code
        else:
            raise AssertionError("a wrong key did not raise openai.AuthenticationError")

    check("models.list", models)
    check("chat.completions", chat_once)
    check("chat.completions stream", chat_stream)
    check("completions", completion)
    check("completions stream", completion_stream)
    check("n=2 raises BadRequestError", n_is_rejected)
    check("a wrong key raises AuthenticationError", wrong_key_is_rejected)

    print(f"{results['passed']} passed, {results['failed']} failed")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
