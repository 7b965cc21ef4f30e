"""Pipeline stages balanced by estimated cost (the lm_head counts), and the override."""

import dataclasses
import itertools
import random
from types import SimpleNamespace

import pytest

from vserve import envs
from vserve.engine.arg_utils import EngineArgs
from vserve.models.partition import (
    head_cost,
    layer_costs,
    parse_partition,
    partition,
    stage_layer_counts,
)
from vserve.models.stage import StageInfo

# gemma-3-270m's shape (the embedded model): 18 layers, a 262k x 640 head
GEMMA_270M = SimpleNamespace(
    hidden_size=640,
    intermediate_size=2048,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    num_hidden_layers=18,
    vocab_size=262144,
    sliding_window=512,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
)


def _stage_costs(counts, costs, first_extra, last_extra):
    out, start = [], 0
    for s, n in enumerate(counts):
        extra = (first_extra if s == 0 else 0) + (last_extra if s == len(counts) - 1 else 0)
        out.append(sum(costs[start : start + n]) + extra)
        start += n
    return out


def test_uniform_layers_split_evenly_earlier_stages_take_the_remainder():
    assert partition([1.0] * 10, 3) == [4, 3, 3]
    assert partition([1.0] * 8, 2) == [4, 4]
    assert partition([1.0] * 4, 4) == [1, 1, 1, 1]


def test_the_lm_head_moves_layers_off_the_last_stage():
    assert partition([1.0] * 10, 2, last_extra=4.0) == [7, 3]
    assert partition([1.0] * 4, 2, last_extra=10.0) == [4, 0]  # the head alone is the pace
    assert partition([1.0] * 6, 3, first_extra=2.0) == [1, 3, 2]  # the embedding counts


def test_embedded_model_head_costs_as_much_as_most_layers():
    costs = layer_costs(GEMMA_270M, 256)
    assert 13 * costs[0] < head_cost(GEMMA_270M) < 15 * costs[0]  # 2x multiply-adds a layer
    assert stage_layer_counts(GEMMA_270M, 2, 256) == (16, 2)  # measured best: 14..17 + rest
    assert stage_layer_counts(GEMMA_270M, 3, 256) == (9, 9, 0)  # even where the pace allows
    assert stage_layer_counts(GEMMA_270M, 1, 256) == (18,)
    # sliding layers see at most their window
    long = layer_costs(GEMMA_270M, 4096)
    assert long[0] < long[5] and long[0] == layer_costs(GEMMA_270M, 512)[0]


@pytest.mark.parametrize("seed", range(20))
def test_partition_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    n, stages = rng.randint(1, 7), rng.randint(1, 4)
    costs = [rng.uniform(0.1, 5) for _ in range(n)]
    first, last = rng.choice([0, 0.5, 3]), rng.choice([0, 2, 10])
    got = partition(costs, stages, first, last)
    assert len(got) == stages and sum(got) == n and min(got) >= 0
    best = min(
        max(_stage_costs(c, costs, first, last))
        for c in itertools.product(range(n + 1), repeat=stages)
        if sum(c) == n
    )
    assert max(_stage_costs(got, costs, first, last)) == pytest.approx(best)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("10,x", "comma-separated integers"),
        ("18", "has 1 stages"),
        ("10,9", "summing to"),
        ("19,-1", "summing to"),
        ("", "comma-separated"),
    ],
)
def test_override_is_checked(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_partition(spec, 18, 2)


def test_override_wins_and_zero_layer_stages_are_allowed():
    assert stage_layer_counts(GEMMA_270M, 2, 256, "10,8") == (10, 8)
    assert stage_layer_counts(GEMMA_270M, 3, 256, "0,18,0") == (0, 18, 0)


def test_stage_info_from_counts():
    stages = [StageInfo.from_counts((3, 0, 2), r) for r in range(3)]
    assert [(s.start_layer, s.end_layer, s.is_first, s.is_last) for s in stages] == [
        (0, 3, True, False),
        (3, 3, False, False),
        (3, 5, False, True),
    ]


def test_engine_config_takes_the_env_override(tiny_model_dir, monkeypatch):
    model = tiny_model_dir("qwen3")  # 4 layers
    args = EngineArgs(model=model, dtype="float32", pipeline_parallel_size=2)
    assert sum(args.create_engine_config().parallel.layer_partition) == 4
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, pp_layer_partition="3,1"))
    assert args.create_engine_config().parallel.layer_partition == (3, 1)
    monkeypatch.setattr(envs, "ENV", dataclasses.replace(envs.ENV, pp_layer_partition="3,2"))
    with pytest.raises(ValueError, match="VSERVE_PP_LAYER_PARTITION"):
        args.create_engine_config()
    single = EngineArgs(model=model, dtype="float32")
    assert single.create_engine_config().parallel.layer_partition == ()
