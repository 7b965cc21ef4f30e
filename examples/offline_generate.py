"""Offline generation with `LLM.generate` on the embedded Gemma-3-270M (no server).

python examples/offline_generate.py
"""

from vserve import LLM, SamplingParams


def main() -> None:
    llm = LLM(max_model_len=1024)  # model=None: the embedded Gemma-3-270M
    prompts = ["The capital of France is", "A haiku about the sea:", "def fibonacci(n):"]
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy)):
        print(f">>> {prompt}\n{out.outputs[0].text}\n")
    chat = llm.chat(
        [{"role": "user", "content": "Name three colours."}],
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=48, seed=0),
    )
    print(">>> chat\n" + chat[0].outputs[0].text)
    llm.shutdown()


if __name__ == "__main__":
    main()
