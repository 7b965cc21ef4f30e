"""How many decoder layers each pipeline stage holds: balanced by estimated cost.

A stage's cost is what it computes per token: multiply-adds of its layers' linears and of
attention over a nominal context, plus, on the stage that holds them, the embedding gather
(first stage) and the final norm and lm_head (last stage). On a small model with a large
vocabulary the lm_head dominates: gemma-3-270m's 262k x 640 head costs more than its 18 layers
together, so an even split leaves the first stage idle most of the time. `partition` picks the
contiguous split with the smallest most expensive stage (the pipeline's pace).

A layer's multiply-adds count `LAYER_COST_FACTOR` times those of the head: the head is one
large matmul that streams its weights at full speed, a layer seven smaller ones with attention,
norms and activations between them. Measured on the embedded model (bf16, CPU, 16 rows a decode
step, one thread a stage): 1.25-1.56 ms a layer against 21.5-22.4 ms for the head, about twice
the head's time per multiply-add; PP=2 then splits it 16 + 2 (decode stages within 1.2x of each
other) where multiply-adds alone gave 18 + 0 (the first stage 1.3x the second, and every
prefill on one stage).

Override with `VSERVE_PP_LAYER_PARTITION="10,8"` (layers per stage, first to last; vLLM's
`VLLM_PP_LAYER_PARTITION`), parsed and checked by `parse_partition`.
"""

from __future__ import annotations

LAYER_COST_FACTOR = 2.0  # a layer's time per multiply-add, relative to the head's


def layer_costs(hf_config, context_len: int) -> list[float]:
    """Cost per token of each decoder layer: its multiply-adds (q/k/v/o and the gated MLP,
    plus q.k and p.v over `context_len` tokens, or the layer's sliding window if smaller)
    times `LAYER_COST_FACTOR`."""
    hidden = hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    linear = (
        hidden * (heads + 2 * kv_heads) * head_dim
        + heads * head_dim * hidden
        + 3 * hidden * hf_config.intermediate_size
    )
    window = getattr(hf_config, "sliding_window", None)
    types = (
        getattr(hf_config, "layer_types", None) or ["full_attention"] * hf_config.num_hidden_layers
    )
    costs = []
    for kind in types[: hf_config.num_hidden_layers]:
        ctx = min(context_len, window) if kind == "sliding_attention" and window else context_len
        costs.append(LAYER_COST_FACTOR * (linear + 2 * heads * head_dim * ctx))
    return costs


def head_cost(hf_config) -> float:
    """Final norm and lm_head per token (every decode token samples)."""
    return float(hf_config.hidden_size * (hf_config.vocab_size + 1))


def partition(
    costs: list[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Layers per stage (contiguous, in order) minimizing the largest stage cost, where the
    first stage also pays `first_extra` and the last `last_extra`; among those, the most even
    one (smallest sum of squared stage costs; then layers on earlier stages). A stage may hold
    no layer when that is cheaper (e.g. a last stage with only the lm_head)."""
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (
            last_extra if stage == num_stages - 1 else 0.0
        )
        return prefix[end] - prefix[start] + extra

    # best[s][i]: (max cost, sum of squares) of stages s.. holding layers i..n-1;
    # choice[s][i]: where stage s ends
    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[n] * (n + 1) for _ in range(num_stages + 1)]
    best[num_stages][n] = (0.0, 0.0)
    for s in range(num_stages - 1, -1, -1):
        for i in range(n, -1, -1):
            ends = [n] if s == num_stages - 1 else range(n, i - 1, -1)
            for end in ends:  # most layers first: ties keep layers early
                cost, rest = stage_cost(s, i, end), best[s + 1][end]
                value = (max(cost, rest[0]), cost * cost + rest[1])
                if value < best[s][i]:
                    best[s][i], choice[s][i] = value, end
    counts, start = [], 0
    for s in range(num_stages):
        end = choice[s][start]
        counts.append(end - start)
        start = end
    return counts


def parse_partition(spec: str, num_layers: int, num_stages: int) -> list[int]:
    """`"10,8"` -> [10, 8]: one non-negative count per stage, summing to the layer count."""
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"VSERVE_PP_LAYER_PARTITION must be comma-separated integers, got {spec!r}"
        ) from None
    if len(counts) != num_stages:
        raise ValueError(
            f"VSERVE_PP_LAYER_PARTITION={spec!r} has {len(counts)} stages, but "
            f"pipeline_parallel_size is {num_stages}"
        )
    if any(c < 0 for c in counts) or sum(counts) != num_layers:
        raise ValueError(
            f"VSERVE_PP_LAYER_PARTITION={spec!r} must be counts >= 0 summing to "
            f"the model's {num_layers} layers"
        )
    return counts


def stage_layer_counts(
    hf_config, num_stages: int, context_len: int, override: str | None = None
) -> tuple[int, ...]:
    """The layers of each stage: the override if given, else the cost-balanced split."""
    num_layers = hf_config.num_hidden_layers
    if override:
        return tuple(parse_partition(override, num_layers, num_stages))
    if num_stages == 1:
        return (num_layers,)
    costs = layer_costs(hf_config, context_len)
    return tuple(partition(costs, num_stages, float(hf_config.hidden_size), head_cost(hf_config)))
