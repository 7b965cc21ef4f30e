"""Embeddings, offline (`LLM.embed`) and through a running server (`/v1/embeddings`).

python examples/embeddings.py                          # offline, on the embedded Gemma-3-270M
python examples/embeddings.py http://127.0.0.1:8000/v1  # a `vserve serve` running

The embedded model is a generative one (last-token pooling, normalized): use an embedding
model (Qwen3-Embedding, gte-Qwen2) for retrieval; the calls are the same.
"""

import sys


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b))  # the vectors are normalized


def main() -> None:
    texts = ["The capital of France is Paris.", "Paris is in France.", "Bananas are yellow."]
    if len(sys.argv) > 1:
        from openai import OpenAI

        client = OpenAI(base_url=sys.argv[1], api_key="EMPTY")
        model = client.models.list().data[0].id
        vectors = [d.embedding for d in client.embeddings.create(model=model, input=texts).data]
    else:
        from vserve import LLM

        llm = LLM(max_model_len=1024)
        vectors = [o.outputs.embedding for o in llm.embed(texts)]
        llm.shutdown()
    print(f"{len(vectors)} vectors of {len(vectors[0])} numbers")
    for i in range(1, len(texts)):
        print(f"cosine({texts[0]!r}, {texts[i]!r}) = {cosine(vectors[0], vectors[i]):.3f}")


if __name__ == "__main__":
    main()
