"""Workload generators. Each returns a `Workload` with token ids, seeded and deterministic.

- `shared_prefix`: the original QuillCache synthetic workload: groups of requests share
  a system prompt of `shared_prefix_blocks` blocks, then add unique blocks.
- `sglang_gsp`: SGLang's bench_serving "generated-shared-prefix" dataset (groups of
  questions after one long system prompt per group; defaults as in SGLang: 64 groups x
  16 prompts, 2048-token system prompt, 128-token question, 256 output tokens).
  Both are groups of requests sharing a prefix (`_group_items`).
- `multi_turn`: chat sessions; each turn resends the history plus the model's answer.
- `agent_fanout`: agent tasks: a planner call, N parallel tool/sub-agent calls sharing
  the planner's context, then a join call over everything.

Arrivals are Poisson at `rate` requests/s. Sessions and tasks start Poisson; by
default (`closed_loop=True`) a later turn is sent when the previous one has finished
plus a think time, a fan-out call when the planner has finished plus the step delay,
the join when every call has finished plus the step delay, as real clients do
(`quillcache.sim.release`). `closed_loop=False` replays the same requests open loop, at
the start plus the delays, as earlier versions did.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from quillcache.errors import ConfigError
from quillcache.sim.requests import TOKEN_HI, TOKEN_LO, SimRequest, make_request
from quillcache.sim.workload import DEFAULT_MODEL, Workload, sim_namespace

Tokens = npt.NDArray[np.uint32]


def _tokens(rng: np.random.Generator, n: int) -> Tokens:
    return rng.integers(TOKEN_LO, TOKEN_HI, size=max(n, 0), dtype=np.uint32)


def _poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> npt.NDArray[np.float64]:
    if rate <= 0:
        raise ConfigError(f"arrival rate must be positive, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def _bursty_arrivals(
    rng: np.random.Generator, n: int, rate: float, factor: float, period_s: float, share: float
) -> npt.NDArray[np.float64]:
    """Poisson arrivals whose rate is `rate * factor` for the first `share` of every
    `period_s` and lower for the rest, so the mean stays `rate` (an on/off modulated
    Poisson process: traffic in bursts). Each piece is drawn on its own (memoryless)."""
    if rate <= 0:
        raise ConfigError(f"arrival rate must be positive, got {rate}")
    if not (factor >= 1 and period_s > 0 and 0 < share < 1 and factor * share <= 1):
        raise ConfigError(
            "bursts need burst_factor >= 1, burst_period_s > 0, 0 < burst_share < 1 and "
            f"burst_factor x burst_share <= 1 (the mean rate), got {factor}, {period_s}, {share}"
        )
    on, off = rate * factor, rate * (1 - factor * share) / (1 - share)
    out: list[float] = []
    t = 0.0
    while len(out) < n:
        k, into = divmod(t, period_s)
        bursting = into < share * period_s
        end = k * period_s + (share * period_s if bursting else period_s)
        r = on if bursting else off
        if r <= 0:
            t = end
            continue
        t_next = t + float(rng.exponential(1.0 / r))
        if t_next < end:
            out.append(t_next)
            t = t_next
        else:
            t = end
    return np.asarray(out, dtype=np.float64)


class _Item(NamedTuple):
    """A request before sorting: its open-loop arrival, and for closed loop the items
    (indices into the item list) it waits for and its wait after them."""

    t: float
    tokens: Tokens
    output: int
    session: str | None
    parents: tuple[int, ...] = ()
    wait_s: float = 0.0


def _finish(
    name: str,
    items: list[_Item],
    block_size: int,
    model: str,
    params: dict[str, Any],
    *,
    closed_loop: bool = False,
) -> Workload:
    """Sort items by open-loop arrival (stable), build requests, and with `closed_loop`
    keep their parents (as request ids)."""
    ns = sim_namespace(block_size, model)
    order = sorted(range(len(items)), key=lambda i: items[i].t)
    rid_of = {i: rid for rid, i in enumerate(order)}
    reqs: list[SimRequest] = []
    for rid, i in enumerate(order):
        it = items[i]
        parents = tuple(rid_of[p] for p in it.parents) if closed_loop else ()
        reqs.append(
            make_request(
                rid,
                float(it.t),
                it.output,
                block_size,
                ns,
                tokens=it.tokens,
                session_id=it.session,
                parents=parents,
                wait_s=it.wait_s if parents else 0.0,
            )
        )
    return Workload(name=name, requests=reqs, block_size=block_size, model=model, params=params)


def _group_items(
    rng: np.random.Generator,
    prefixes: list[Tokens],
    groups: npt.NDArray[np.int64],
    arrivals: npt.NDArray[np.float64],
    suffix_len: int,
    output_tokens: int,
) -> list[_Item]:
    """Request i: the prefix of group `groups[i]` + `suffix_len` tokens of its own,
    arriving at `arrivals[i]`, with the group as its session (the shape shared by the
    shared-prefix and SGLang generated-shared-prefix workloads)."""
    return [
        _Item(
            float(arrivals[i]),
            np.concatenate([prefixes[g], _tokens(rng, suffix_len)]),
            output_tokens,
            f"group-{g}",
        )
        for i, g in enumerate(groups.tolist())
    ]


def shared_prefix(
    *,
    requests: int = 2000,
    prefix_groups: int = 8,
    shared_prefix_blocks: int = 32,
    unique_blocks: int = 8,
    output_tokens: int = 128,
    block_size: int = 16,
    rate: float = 40.0,
    zipf: float = 0.0,
    pinned_groups: int = 0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    burst_factor: float = 1.0,
    burst_period_s: float = 10.0,
    burst_share: float = 0.2,
) -> Workload:
    """Requests = one of `prefix_groups` shared prefixes + `unique_blocks` of their own
    (+ a partial block). Groups are drawn uniformly, or Zipf-like with exponent `zipf`
    (group 0 the most popular). Every engine pins the first `pinned_groups` prefixes.
    `burst_factor` > 1: arrivals come in bursts, `burst_factor` times the mean rate for
    the first `burst_share` of every `burst_period_s`, fewer between (the mean stays
    `rate`)."""
    if min(requests, prefix_groups, block_size) <= 0 or shared_prefix_blocks < 0:
        raise ConfigError("requests, prefix groups and block size must be positive")
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, shared_prefix_blocks * block_size) for _ in range(prefix_groups)]
    if zipf > 0:
        w = 1.0 / np.arange(1, prefix_groups + 1) ** zipf
        groups = rng.choice(prefix_groups, size=requests, p=w / w.sum())
    else:
        groups = rng.integers(0, prefix_groups, size=requests)
    if burst_factor == 1.0:
        arrivals = _poisson_arrivals(rng, requests, rate)
    else:
        arrivals = _bursty_arrivals(rng, requests, rate, burst_factor, burst_period_s, burst_share)
    tail = unique_blocks * block_size + block_size // 2
    items = _group_items(rng, prefixes, groups, arrivals, tail, output_tokens)
    params = dict(
        requests=requests,
        prefix_groups=prefix_groups,
        shared_prefix_blocks=shared_prefix_blocks,
        unique_blocks=unique_blocks,
        output_tokens=output_tokens,
        block_size=block_size,
        rate=rate,
        zipf=zipf,
        pinned_groups=pinned_groups,
        seed=seed,
    )
    if burst_factor != 1.0:
        params.update(
            burst_factor=burst_factor, burst_period_s=burst_period_s, burst_share=burst_share
        )
    wl = _finish("shared-prefix", items, block_size, model, params)
    ns = sim_namespace(block_size, model)
    wl.pinned = [
        make_request(-1 - g, 0.0, 0, block_size, ns, tokens=prefixes[g])
        for g in range(min(pinned_groups, prefix_groups))
    ]
    return wl


def sglang_gsp(
    *,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    block_size: int = 16,
    rate: float = 20.0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """SGLang's generated-shared-prefix dataset, shuffled, with Poisson arrivals."""
    if min(num_groups, prompts_per_group, block_size) <= 0:
        raise ConfigError("groups, prompts per group and block size must be positive")
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, system_prompt_len) for _ in range(num_groups)]
    groups = rng.permutation(np.repeat(np.arange(num_groups), prompts_per_group))
    arrivals = _poisson_arrivals(rng, len(groups), rate)
    items = _group_items(rng, systems, groups, arrivals, question_len, output_len)
    params = dict(
        num_groups=num_groups,
        prompts_per_group=prompts_per_group,
        system_prompt_len=system_prompt_len,
        question_len=question_len,
        output_len=output_len,
        block_size=block_size,
        rate=rate,
        seed=seed,
    )
    return _finish("sglang-gsp", items, block_size, model, params)


def multi_turn(
    *,
    sessions: int = 200,
    turns: int = 6,
    system_prompt_len: int = 1024,
    user_len: int = 96,
    output_len: int = 192,
    think_time_s: float = 8.0,
    block_size: int = 16,
    rate: float = 4.0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    closed_loop: bool = True,
    background_rate: float = 0.0,
    background_len: int = 2048,
    background_output_len: int = 64,
) -> Workload:
    """Chat sessions: turn k's prompt = system + (user, answer) x k + user. Sessions share
    one system prompt; session starts are Poisson at `rate`; each next turn comes an
    exponential think time after the previous one finished (closed loop) or, open
    loop, after the previous one's arrival.

    `background_rate` > 0 adds other traffic: one-off prompts of `background_len`
    random tokens (no session), Poisson at that rate from 0 until one think time after
    the last turn's open-loop time. They fill the engines' caches, so a session whose
    think (tool) time outlasts its engine's LRU turnover comes back to an evicted
    prefix, unless something keeps it warm. Drawn from a generator of their own: the
    sessions are the same with or without them."""
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_prompt_len)
    starts = _poisson_arrivals(rng, sessions, rate)
    items: list[_Item] = []
    for s in range(sessions):
        t = float(starts[s])
        history = system
        think = 0.0
        for k in range(turns):
            history = np.concatenate([history, _tokens(rng, user_len)])
            previous = (len(items) - 1,) if k else ()
            items.append(_Item(t, history, output_len, f"session-{s}", previous, think))
            history = np.concatenate([history, _tokens(rng, output_len)])
            think = float(rng.exponential(think_time_s))
            t += think
    if background_rate < 0 or background_len < 0 or background_output_len < 1:
        raise ConfigError("background rate and length must be >= 0, its output >= 1 token")
    if background_rate > 0:
        bg = np.random.default_rng([seed, 1])
        until = max(it.t for it in items) + think_time_s
        n = int(bg.poisson(background_rate * until))
        for at in np.sort(bg.uniform(0.0, until, size=n)).tolist():
            items.append(_Item(at, _tokens(bg, background_len), background_output_len, None))
    params = dict(
        sessions=sessions,
        turns=turns,
        system_prompt_len=system_prompt_len,
        user_len=user_len,
        output_len=output_len,
        think_time_s=think_time_s,
        block_size=block_size,
        rate=rate,
        seed=seed,
        closed_loop=closed_loop,
    )
    if background_rate > 0:
        params.update(
            background_rate=background_rate,
            background_len=background_len,
            background_output_len=background_output_len,
        )
    return _finish("multi-turn", items, block_size, model, params, closed_loop=closed_loop)


def agent_fanout(
    *,
    tasks: int = 100,
    fanout: int = 6,
    context_len: int = 4096,
    step_len: int = 128,
    output_len: int = 256,
    step_delay_s: float = 2.0,
    block_size: int = 16,
    rate: float = 2.0,
    seed: int = 0,
    model: str = DEFAULT_MODEL,
    closed_loop: bool = True,
) -> Workload:
    """Agent DAGs: planner(context) -> `fanout` calls (context + plan + own instruction)
    -> join(context + plan + every call's result). Closed loop, the calls are sent
    `step_delay_s` after the planner finished and the join `step_delay_s` after the
    last call finished (tool / orchestration time); open loop, at the task's start
    plus one and two step delays."""
    rng = np.random.default_rng(seed)
    tool_prompt = _tokens(rng, 512)  # the same tool definitions for every task
    starts = _poisson_arrivals(rng, tasks, rate)
    items: list[_Item] = []
    for k in range(tasks):
        t = float(starts[k])
        context = np.concatenate([tool_prompt, _tokens(rng, context_len)])
        planner = len(items)
        items.append(_Item(t, context, output_len, f"task-{k}"))
        plan = np.concatenate([context, _tokens(rng, output_len)])
        results = []
        for _ in range(fanout):
            call = np.concatenate([plan, _tokens(rng, step_len)])
            items.append(
                _Item(t + step_delay_s, call, output_len, f"task-{k}", (planner,), step_delay_s)
            )
            results.append(_tokens(rng, output_len))
        join = np.concatenate([plan, *results, _tokens(rng, step_len)])
        calls = tuple(range(planner + 1, planner + 1 + fanout))
        items.append(
            _Item(t + 2 * step_delay_s, join, output_len, f"task-{k}", calls, step_delay_s)
        )
    params = dict(
        tasks=tasks,
        fanout=fanout,
        context_len=context_len,
        step_len=step_len,
        output_len=output_len,
        step_delay_s=step_delay_s,
        block_size=block_size,
        rate=rate,
        seed=seed,
        closed_loop=closed_loop,
    )
    return _finish("agent-fanout", items, block_size, model, params, closed_loop=closed_loop)


GENERATORS: dict[str, Callable[..., Workload]] = {
    "shared-prefix": shared_prefix,
    "sglang-gsp": sglang_gsp,
    "multi-turn": multi_turn,
    "agent-fanout": agent_fanout,
}

#: Parameters that must be above 0 (the others that are numbers: at least 0).
_POSITIVE = frozenset({"rate", "block_size"})


def checked_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """`params` for the generator `name`, or a ConfigError naming the first that is not
    one of its parameters or not a value it takes: each of the type of its default (a
    whole number where the default is one), finite, and at least 0 (`rate` and
    `block_size` above 0). A NaN rate would otherwise surface as a message about
    something else."""
    if name not in GENERATORS:
        raise ConfigError(f"unknown generator {name!r}; known: {', '.join(GENERATORS)}")
    accepted = {k: p.default for k, p in inspect.signature(GENERATORS[name]).parameters.items()}
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in accepted:
            known = ", ".join(sorted(set(accepted) - {"model"}))
            raise ConfigError(f"{key!r} is not a parameter of {name}; known: {known}")
        out[key] = _checked_value(name, key, value, accepted[key])
    return out


def _checked_value(name: str, key: str, value: Any, default: Any) -> Any:
    where = f"{name} parameter {key!r}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    whole = isinstance(default, int)
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        kind = "a whole number" if whole else "a number"
        raise ConfigError(f"{where} must be {kind}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (key in _POSITIVE and value == 0):
        bound = "above 0" if key in _POSITIVE else "at least 0"
        raise ConfigError(f"{where} must be a finite number {bound}, got {value!r}")
    return value
