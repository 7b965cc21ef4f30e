"""Text completions from a running `vserve serve` through the official `openai` client:
a batch of prompts with n choices each, logprobs, and a streamed completion.

    vserve serve &
    python examples/openai_completion_client.py [--base-url http://127.0.0.1:8000/v1]
"""

import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id

    prompts = ["The capital of France is", "Once upon a time"]
    batch = client.completions.create(
        model=model, prompt=prompts, n=2, max_tokens=16, temperature=0.8, seed=0
    )
    for choice in batch.choices:  # index = prompt_index * n + choice
        print(f"[{choice.index}] {prompts[choice.index // 2]!r} -> {choice.text!r}")

    scored = client.completions.create(
        model=model, prompt=prompts[0], max_tokens=5, temperature=0, logprobs=3
    )
    lp = scored.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        print(f"{token!r:>12} {logprob:8.3f}  top: {top}")

    print("\nstreaming: ", end="")
    for chunk in client.completions.create(
        model=model, prompt=prompts[1], max_tokens=32, temperature=0, stream=True
    ):
        print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
