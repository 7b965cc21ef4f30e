"""Chat with a running `vserve serve` through the official `openai` client: one plain request,
then the same one streamed token by token.

    vserve serve &                       # the embedded Gemma-3-270M on 127.0.0.1:8000
    python examples/openai_chat_client.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if any")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You answer in one short paragraph."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]

    reply = client.chat.completions.create(
        model=model, messages=messages, max_tokens=64, temperature=0.7, seed=1
    )
    print(reply.choices[0].message.content)
    print(
        f"[{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} "
        f"completion tokens, finish_reason={reply.choices[0].finish_reason}]\n"
    )

    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=64,
        temperature=0.7,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"top_k": 40, "repetition_penalty": 1.05},
    )  # vLLM-style extras
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n[{chunk.usage.completion_tokens} tokens streamed]")


if __name__ == "__main__":
    main()
