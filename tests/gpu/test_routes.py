"""The route planner (csrc/routes.cpp): every row to the route docs/design/kernel-routing.md gives it, the row lists,
T_eff and the log-prob masks written into the stage, and the filter's grid."""

from __future__ import annotations

import random

import pytest
import torch

BUCKETS = (16, 32, 64, 128, 256)


def expected_routes(t: list[float], k: list[int], p: list[float], m: list[float], vocab: int, kind: int,
                    processing: bool, routing: int, module, num_samples: int = 1) -> dict:
    """The routing table of docs/design/kernel-routing.md, stated row by row."""
    chunks = -(-vocab // 8192)
    processed = kind == module.LOGPROBS_PROCESSED
    use_buckets = routing != module.ROUTES_EXACT
    groups: dict = {"greedy": [], "unfiltered": [], "exact": [], "need_raw": [], "settle": [],
                    **{b: [] for b in BUCKETS}}
    masks = []
    exact_k = exact_p = False
    for r, (tr, kr, pr, mr) in enumerate(zip(t, k, p, m)):
        greedy, filtered = tr == 0, kr > 0 or pr < 1 or mr > 0
        through = filtered and (not greedy or processed)
        if greedy:
            groups["greedy"].append(r)
        elif not filtered:
            groups["unfiltered"].append(r)
        if through:
            bucket = next((b for b in BUCKETS if kr + 1 <= b), 0) if kr > 0 and use_buckets else 0
            if bucket and chunks * bucket <= 16384:
                groups[bucket].append(r)
                if routing == module.ROUTES_SETTLED:
                    groups["settle"].append(r)
            else:
                groups["exact"].append(r)
                exact_k |= kr > 0
                exact_p |= pr < 1
        raw_pass = processing or (not greedy and filtered)
        if kind == module.LOGPROBS_RAW and raw_pass:
            groups["need_raw"].append(r)
        masks.append((through and not greedy, through, raw_pass))
    if processed:
        route = module.EXACT_FILTER
    elif exact_k:
        route = module.EXACT_FILTER if exact_p and num_samples < module.CUT_MIN_SAMPLES_WITH_K else module.EXACT_CUT
    elif not exact_p:
        route = module.EXACT_MIN_P
    elif len(groups["exact"]) >= module.FRONTIER_MIN_ROWS:
        route = module.EXACT_FRONTIER
    else:
        route = module.EXACT_CUT if num_samples >= module.CUT_MIN_SAMPLES_TOP_P else module.EXACT_FILTER
    return {"groups": groups, "masks": masks, "route": route}


def plan_rows(kernels, t, k, p, m, vocab, kind, processing=False, routing=None, num_samples=1):
    """Plans the rows in a stage of their own; returns the plan, the row ids of each group and the stage's T_eff and
    masks."""
    b = len(t)
    layout = kernels.stage_layout(b)
    stage = torch.zeros(layout["bitmask_words"] + 64, dtype=torch.uint8)
    stage[layout["temperature"]: layout["temperature"] + 4 * b].view(torch.float32).copy_(torch.tensor(t))
    stage[layout["top_p"]: layout["top_p"] + 4 * b].view(torch.float32).copy_(torch.tensor(p))
    stage[layout["min_p"]: layout["min_p"] + 4 * b].view(torch.float32).copy_(torch.tensor(m))
    stage[layout["top_k"]: layout["top_k"] + 4 * b].view(torch.int32).copy_(torch.tensor(k, dtype=torch.int32))
    routing = kernels.module.ROUTES_FAST if routing is None else routing
    plan = kernels.plan(stage.data_ptr(), b, vocab, num_samples, kind, processing, routing)
    lists = stage[layout["lists"]: layout["lists"] + 12 * b].view(torch.int32).tolist()

    def rows(group):
        first, n = group
        return list(range(b)) if first == -1 else lists[first: first + n]

    got = {"greedy": rows(plan.greedy), "unfiltered": rows(plan.unfiltered), "exact": rows(plan.exact),
           "need_raw": rows(plan.need_raw), "settle": rows(plan.settle), **{bucket: rows(g) for bucket, g in zip(BUCKETS, plan.buckets)}}
    t_eff = stage[layout["temperature"]: layout["temperature"] + 4 * b].view(torch.float32).tolist()
    masks = stage[layout["masks"]: layout["masks"] + 3 * b].view(torch.bool).view(3, b).t().tolist()
    return plan, got, t_eff, [tuple(row) for row in masks]


def random_rows(rng: random.Random, b: int, vocab: int):
    t = [rng.choice([0.0, 0.7, 1.0]) for _ in range(b)]
    k = [rng.choice([0, 0, 1, 15, 16, 50, 127, 255, 256, 1000, vocab - 1]) for _ in range(b)]
    p = [rng.choice([1.0, 1.0, 0.9, 0.5]) for _ in range(b)]
    m = [rng.choice([0.0, 0.0, 0.05]) for _ in range(b)]
    return t, k, p, m


@pytest.mark.parametrize("vocab", [111, 32000, 151936, 262144])
@pytest.mark.parametrize("kind_name", ["TOKENS", "LOGPROBS_RAW", "LOGPROBS_PROCESSED"])
@pytest.mark.parametrize("processing", [False, True])
def test_plan_follows_the_routing_table(sampling_kernels, vocab, kind_name, processing):
    module = sampling_kernels.module
    kind = getattr(module, kind_name)
    rng = random.Random(vocab * 7 + kind)
    for b in (1, 2, 7, 31, 32, 33, 100, 300):
        routings = [module.ROUTES_FAST, module.ROUTES_EXACT] + [module.ROUTES_SETTLED] * (kind == module.TOKENS)
        for routing in routings:
            num_samples = rng.choice([1, 1, 2, 5, 8, 9])
            t, k, p, m = random_rows(rng, b, vocab)
            plan, got, t_eff, masks = plan_rows(sampling_kernels, t, k, p, m, vocab, kind, processing, routing,
                                                num_samples)
            want = expected_routes(t, k, p, m, vocab, kind, processing, routing, module, num_samples)
            assert plan.num_samples == num_samples
            assert got == want["groups"], (b, routing)
            assert plan.exact_route == want["route"] or not got["exact"], (b, routing, num_samples)
            assert plan.settle_splits == module.filter_splits(len(got["settle"]), True)
            assert t_eff == [1.0 if x == 0 else x for x in torch.tensor(t).tolist()]  # float32 values
            if kind != module.TOKENS:
                assert masks == want["masks"]
            assert plan.lists_used == sum(len(g) for g in got.values() if 0 < len(g) < b)


def test_uniform_rows_need_no_list(sampling_kernels):
    """A batch whose rows share one route is one group of every row: no row ids go up."""
    module = sampling_kernels.module
    for t, k, p, m in ((0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (1.0, 50, 0.9, 0.0), (1.0, 0, 0.9, 0.0),
                       (1.0, 0, 1.0, 0.05), (1.0, 4096, 0.9, 0.0)):
        plan, got, _, _ = plan_rows(sampling_kernels, [t] * 64, [k] * 64, [p] * 64, [m] * 64, 151936, module.TOKENS)
        assert plan.lists_used == 0
        assert sum(len(g) == 64 for g in got.values()) == 1


def test_frontier_from_its_row_count(sampling_kernels):
    """Top-p without k takes the frontier from FRONTIER_MIN_ROWS rows, the filter below, with the grids the
    planner gives each (one block a multiprocessor after the frontier, two after stats)."""
    module = sampling_kernels.module
    n = module.FRONTIER_MIN_ROWS
    for b, route in ((n - 1, module.EXACT_FILTER), (n, module.EXACT_FRONTIER)):
        plan, *_ = plan_rows(sampling_kernels, [1.0] * b, [0] * b, [0.9] * b, [0.0] * b, 151936, module.TOKENS)
        assert plan.exact_route == route
        assert plan.filter_splits == module.filter_splits(b, route == module.EXACT_FRONTIER)
    assert module.filter_splits(1, False) == 64 and module.filter_splits(1, True) == 64
    assert module.filter_splits(132, False) == 2 and module.filter_splits(132, True) == 1


def test_several_samples_take_the_cut_for_top_p(sampling_kernels):
    """Rows with top-p that one sample sends to the filter take the cut route from CUT_MIN_SAMPLES_WITH_K samples a
    row when they have a k, from CUT_MIN_SAMPLES_TOP_P without k (below the frontier's row count). The frontier's
    rows and processed log-probs keep their routes."""
    module = sampling_kernels.module
    with_k, top_p, few = module.CUT_MIN_SAMPLES_WITH_K, module.CUT_MIN_SAMPLES_TOP_P, module.FRONTIER_MIN_ROWS - 1
    filt, cut = module.EXACT_FILTER, module.EXACT_CUT
    cases = (  # rows (k, p, b), kind, then (samples, route) pairs
        ((1000, 0.9, 8), module.TOKENS, ((1, filt), (with_k - 1, filt), (with_k, cut), (64, cut))),
        ((1000, 0.9, 8), module.LOGPROBS_RAW, ((1, filt), (with_k, cut))),
        ((1000, 0.9, 8), module.LOGPROBS_PROCESSED, ((1, filt), (with_k, filt), (64, filt))),
        ((0, 0.9, few), module.TOKENS, ((1, filt), (top_p - 1, filt), (top_p, cut), (64, cut))),
        ((0, 0.9, few + 1), module.TOKENS, ((1, module.EXACT_FRONTIER), (64, module.EXACT_FRONTIER))),
        ((1000, 1.0, 8), module.TOKENS, ((1, cut), (64, cut))),
    )
    for (k, p, b), kind, routes in cases:
        for num_samples, route in routes:
            plan, *_ = plan_rows(sampling_kernels, [1.0] * b, [k] * b, [p] * b, [0.0] * b, 151936, kind,
                                 routing=module.ROUTES_FAST, num_samples=num_samples)
            assert plan.exact_route == route, (k, p, b, kind, num_samples)
            assert plan.filter_splits == module.filter_splits(b, route == module.EXACT_FRONTIER)


def test_workspace_covers_every_launch(sampling_kernels):
    """The plan's workspace is at least what each of its launches asks for."""
    module = sampling_kernels.module
    b, vocab = 40, 151936
    plan, *_ = plan_rows(sampling_kernels, [1.0] * b, [4096] * b, [0.9] * b, [0.0] * b, vocab, module.TOKENS)
    counters, hist, scratch = plan.workspace()
    assert counters >= 4 * b and hist == module.hist_bytes(b) * (plan.filter_splits > 1)
    assert scratch >= module.stats_scratch_bytes(b, vocab)
    plan, *_ = plan_rows(sampling_kernels, [1.0] * b, [50] * b, [1.0] * b, [0.0] * b, vocab, module.TOKENS)
    assert plan.workspace()[2] >= module.topk_scratch_bytes(b, vocab, 64)


def test_settled_routes_are_for_token_calls(sampling_kernels):
    """The settle group writes tokens and flags alone: a log-prob call cannot be planned with it."""
    module = sampling_kernels.module
    for kind in (module.LOGPROBS_RAW, module.LOGPROBS_PROCESSED):
        with pytest.raises(ValueError):
            plan_rows(sampling_kernels, [1.0] * 4, [50] * 4, [1.0] * 4, [0.0] * 4, 32000, kind,
                      routing=module.ROUTES_SETTLED)


def test_workspace_covers_the_settle_group(sampling_kernels):
    """The settle group's stats and filter fit the plan's workspace (its histograms too when it splits rows)."""
    module = sampling_kernels.module
    b, vocab = 8, 151936
    plan, got, *_ = plan_rows(sampling_kernels, [1.0] * b, [50] * b, [0.9] * b, [0.0] * b, vocab, module.TOKENS,
                              routing=module.ROUTES_SETTLED)
    assert got["settle"] == list(range(b)) and plan.settle_splits > 1
    counters, hist, scratch = plan.workspace()
    assert counters >= 4 * b and hist >= module.hist_bytes(b) and scratch >= module.stats_scratch_bytes(b, vocab)
