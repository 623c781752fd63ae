"""`quillcache simulate`: replay a workload over routers x index backends [x sweep].

With no arguments: the synthetic shared-prefix workload, every built-in router, the
native index, 4 workers, full timing; prints a comparison table. See
`docs/simulator.md` for every flag and the published results.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from quillcache.routing import SLO

UNBOUNDED = 1 << 31  # blocks: more than any run can fill


def add_arguments(p: argparse.ArgumentParser) -> None:
    wl = p.add_argument_group("workload")
    wl.add_argument("--trace", metavar="JSONL", help="replay a Mooncake-format trace")
    wl.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace block id (512)"
    )
    wl.add_argument(
        "--per-block-ids",
        action="store_true",
        help="trace ids name one block's content, not a chained prefix",
    )
    wl.add_argument("--limit", type=int, help="only the first N trace requests")
    wl.add_argument(
        "--workload",
        default="shared-prefix",
        choices=["shared-prefix", "sglang-gsp", "multi-turn", "agent-fanout"],
        help="generator when no --trace is given (default shared-prefix)",
    )
    wl.add_argument("--requests", type=int, default=1500, help="shared-prefix: requests")
    wl.add_argument("--prefix-groups", type=int, default=64, help="shared-prefix: groups")
    wl.add_argument(
        "--shared-prefix-blocks", type=int, default=128, help="shared-prefix: blocks per prefix"
    )
    wl.add_argument("--unique-blocks", type=int, default=32, help="shared-prefix: own blocks")
    wl.add_argument("--output-tokens", type=int, default=128, help="shared-prefix: output")
    wl.add_argument(
        "--rate", type=float, help="arrivals per second (shared-prefix: 30; others: their own)"
    )
    wl.add_argument("--zipf", type=float, default=1.0, help="shared-prefix: group skew")
    wl.add_argument(
        "--pin-groups",
        type=int,
        default=0,
        help="shared-prefix: every engine pins the N most popular prefixes",
    )
    wl.add_argument("--block-size", type=int, default=16, help="generated workloads' block size")
    wl.add_argument(
        "--gen",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other generator parameter (e.g. --gen turns=8)",
    )
    wl.add_argument(
        "--time-scale", type=float, default=1.0, help="multiply arrival times (<1: faster)"
    )
    wl.add_argument(
        "--open-loop",
        action="store_true",
        help="send every request at its timestamp, not when its parents finished "
        "(multi-turn, agent-fanout, traces with wait_for)",
    )
    wl.add_argument(
        "--no-session-ids",
        action="store_true",
        help="route without the requests' session ids (what a session hint is worth)",
    )
    wl.add_argument(
        "--no-parent-hints",
        action="store_true",
        help="route without the request each one follows (closed loop: what the "
        "agent-DAG / previous-turn hint is worth)",
    )

    cl = p.add_argument_group("cluster")
    cl.add_argument("--workers", default="4", help="workers, or a sweep: 2,4,8")
    cl.add_argument(
        "--capacity",
        default=None,
        help="KV blocks per worker, a sweep (1000,5000,unbounded); default: cost model",
    )
    cl.add_argument(
        "--capacity-tokens", default=None, help="like --capacity, in tokens (rounded down)"
    )
    cl.add_argument("--cpu-blocks", type=int, default=0, help="CPU tier blocks per worker")
    cl.add_argument(
        "--routers",
        default="all",
        help="comma-separated routers (registered names or 'pkg.module:Class'), or 'all'",
    )
    cl.add_argument("--backends", default="native", help="comma-separated index backends")
    cl.add_argument(
        "--router-opt",
        action="append",
        default=[],
        metavar="ROUTER.KEY=VALUE",
        help="router parameter, e.g. mooncake.ttft_slo_s=2",
    )
    cl.add_argument("--no-speculative", action="store_true", help="no speculative residency")
    cl.add_argument(
        "--engine-seqs",
        action="append",
        default=[],
        metavar="WORKER=N",
        help="a worker's sequence slots (max_num_seqs), which its engine runs with and the "
        "gateway is told (repeatable; the others: the cost model's)",
    )
    cl.add_argument(
        "--dp-ranks",
        type=int,
        default=1,
        help="data-parallel ranks per worker, each a full engine with its own KV cache",
    )
    cl.add_argument(
        "--dp-placement",
        default="gateway",
        help="who picks the rank: 'gateway' (the decision's rank, sent as "
        "X-data-parallel-rank) or 'engine' (vLLM's own DP load balancer)",
    )

    pol = p.add_argument_group("policies (docs/simulator.md, 'Policies')")
    pol.add_argument(
        "--replicate",
        action="store_true",
        help="hot-prefix replication: copy a hot prefix onto an idle engine when its "
        "holders are overloaded (full timing)",
    )
    pol.add_argument(
        "--replicate-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a replication knob, e.g. high_wait_s=1 (implies --replicate)",
    )
    pol.add_argument(
        "--retain",
        action="store_true",
        help="session retention: every session asks for its prefix to be kept warm on "
        "its engine (touched before the LRU evicts it) for session_ttl_s (full timing)",
    )
    pol.add_argument(
        "--retain-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a retention knob, e.g. session_ttl_s=600 (implies --retain)",
    )
    pol.add_argument(
        "--slo-ttft",
        type=float,
        default=None,
        metavar="S",
        help="every request's TTFT target (as x-slo-ttft-ms online); the admission stage "
        "rejects a request whose estimate misses it, with every router (full timing)",
    )
    pol.add_argument(
        "--slo-tbt",
        type=float,
        default=None,
        metavar="S",
        help="every request's time-between-tokens target (as x-slo-tbt-ms online)",
    )
    pol.add_argument(
        "--slo-queue",
        action="store_true",
        help="a request the admission stage refuses while waiting could help waits, "
        "retried against what is left of its SLO (the gateway's slo_admission: queue)",
    )
    pol.add_argument(
        "--no-admission",
        action="store_true",
        help="with an SLO, admit every request and only report who met it (the share "
        "without admission)",
    )

    rp = p.add_argument_group("gateway replicas (docs/simulator.md, 'Several replicas')")
    rp.add_argument(
        "--replicas",
        default=None,
        help="gateway replicas behind a load balancer, or a sweep: 1,2,4,8 (default: one "
        "gateway, no replica columns)",
    )
    rp.add_argument(
        "--replica-state",
        default=None,
        help="what replicas share: shared, private, approximate, or a list (default shared)",
    )
    rp.add_argument(
        "--lb", default=None, help="load balancer in front of the replicas: round-robin, random"
    )
    rp.add_argument(
        "--scrape-interval",
        type=float,
        default=None,
        help="private/approximate: seconds between the replicas' engine-metrics scrapes (1)",
    )

    cm = p.add_argument_group("cost model and timing")
    cm.add_argument("--cost-config", metavar="FILE", help="cost-model JSON/YAML")
    cm.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="cost-model override, e.g. gpu.prefill_mfu=0.5",
    )
    cm.add_argument(
        "--timing",
        choices=["full", "none"],
        default="full",
        help="full: timed replay with the cost model (TTFT, E2E); none: order only (hit rates)",
    )
    cm.add_argument("--seed", type=int, default=0, help="seed of generators and random routers")

    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write results as JSON ('-' for stdout)")
    out.add_argument("--perf", action="store_true", help="add wall times and index latencies")
    out.add_argument("--plot", metavar="FILE.png", help="plot hit rate and TTFT per router")
    out.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="runs in N parallel processes (default 0: one per usable CPU; 1: in-process)",
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    out.add_argument("--list-routers", action="store_true", help="list routers and exit")

    mx = p.add_argument_group("matrix (docs/simulator.md, 'The matrix')")
    mx.add_argument(
        "--matrix",
        metavar="GRID",
        help="replay a grid (a TOML file, or quick, full, degenerate) with every router; "
        "writes a results page, JSON and a heatmap",
    )
    mx.add_argument("--out", metavar="DIR", help="--matrix: output directory (matrix-GRID)")
    mx.add_argument(
        "--fresh",
        action="store_true",
        help="--matrix: discard the runs DIR/runs.jsonl keeps instead of resuming from them",
    )
    mx.add_argument(
        "--ray",
        metavar="WHERE",
        help="--matrix: run the grid's runs on Ray (pip install 'quillcache[ray]'): local, "
        "auto, or a cluster's address",
    )


def _kv(items: list[str], what: str) -> dict[str, Any]:
    from quillcache.errors import ConfigError

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} must look like KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _engine_seqs(items: list[str]) -> dict[int, int]:
    """`--engine-seqs WORKER=N`s; every worker named must exist in every `--workers`
    count (`SimConfig.check` says so per run)."""
    from quillcache.errors import ConfigError

    out: dict[int, int] = {}
    for key, value in _kv(items, "--engine-seqs").items():
        try:
            worker = int(key)
        except ValueError:
            raise ConfigError(
                f"--engine-seqs {key}={value}: {key!r} is not a worker number"
            ) from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--engine-seqs {key}={value}: N must be a whole number >= 1")
        out[worker] = value
    return out


def _int_list(raw: str, what: str, *, allow_unbounded: bool = False) -> list[int]:
    from quillcache.errors import ConfigError

    out = []
    for part in raw.split(","):
        part = part.strip().lower()
        if allow_unbounded and part in ("unbounded", "inf", "none"):
            out.append(UNBOUNDED)
            continue
        try:
            value = int(float(part))
        except ValueError:
            raise ConfigError(f"{what}: {part!r} is not a number") from None
        if value <= 0:
            raise ConfigError(f"{what} must be positive, got {value}")
        out.append(value)
    return out


#: The flags of a generated workload (`--trace` refuses them: they would be ignored).
_GENERATOR_FLAGS = (
    "workload",
    "requests",
    "prefix_groups",
    "shared_prefix_blocks",
    "unique_blocks",
    "output_tokens",
    "rate",
    "zipf",
    "pin_groups",
    "block_size",
    "gen",
)


def _defaults() -> dict[str, Any]:
    """Every flag's default, by its `args` name."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def _given(args: argparse.Namespace, dests: tuple[str, ...]) -> list[str]:
    """The flags among `dests` that `args` sets to other than their defaults."""
    default = _defaults()
    return [f"--{d.replace('_', '-')}" for d in dests if vars(args)[d] != default[d]]


def _check_run_numbers(args: argparse.Namespace) -> None:
    """The flags of one run that no generator or trace checks, before any work: the
    seed, the arrival scaling and rate, and where the results go (a missing directory
    said at once, not after the run)."""
    from quillcache.errors import ConfigError

    if args.seed < 0:
        raise ConfigError(f"--seed must be at least 0, got {args.seed}")
    if args.cpu_blocks < 0:
        raise ConfigError(f"--cpu-blocks must be at least 0, got {args.cpu_blocks}")
    if args.fresh:
        raise ConfigError("--fresh needs --matrix")
    if not args.trace:
        given = _given(args, ("per_block_ids", "trace_block_size", "limit"))
        if given:
            raise ConfigError(f"{', '.join(given)} shape a trace's replay: give them with --trace")
    if not (0 < args.time_scale < math.inf):
        raise ConfigError(f"--time-scale must be a positive finite number, got {args.time_scale}")
    if args.rate is not None and not (0 < args.rate < math.inf):
        raise ConfigError(f"--rate must be a positive finite number, got {args.rate}")
    check_output_paths(args.json, args.plot)


def check_output_paths(json_path: str | None, plot_path: str | None) -> None:
    """ConfigError for a --json or --plot that cannot be written, before the run (after
    it, the results would be lost)."""
    from quillcache.errors import ConfigError

    for flag, target in (("--json", json_path), ("--plot", plot_path)):
        if target is None or target == "-":
            continue
        where = Path(target)
        if where.is_dir():
            raise ConfigError(f"{flag} {target} is a directory")
        if not where.parent.is_dir():
            raise ConfigError(f"{flag} {target}: the directory {where.parent} does not exist")


def _workload(args: argparse.Namespace) -> Any:
    from quillcache.errors import ConfigError
    from quillcache.sim.generators import GENERATORS, checked_params
    from quillcache.sim.trace import load_trace

    if args.trace:
        workload = load_trace(
            args.trace,
            block_size=args.trace_block_size,
            chained=not args.per_block_ids,
            limit=args.limit,
        )
        ignored = _given(args, _GENERATOR_FLAGS)
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)} shape a generated workload, not a trace: give them "
                "without --trace (a trace's own options: --trace-block-size, --limit, "
                "--per-block-ids, --time-scale)"
            )
        return workload
    gen = GENERATORS[args.workload]
    params: dict[str, Any] = {"seed": args.seed, "block_size": args.block_size}
    if args.rate is not None:
        params["rate"] = args.rate
    if args.workload == "shared-prefix":
        params.setdefault("rate", 30.0)
        params.update(
            requests=args.requests,
            prefix_groups=args.prefix_groups,
            shared_prefix_blocks=args.shared_prefix_blocks,
            unique_blocks=args.unique_blocks,
            output_tokens=args.output_tokens,
            zipf=args.zipf,
            pinned_groups=args.pin_groups,
        )
    params.update(_kv(args.gen, "--gen"))
    params = checked_params(args.workload, params)
    try:
        return gen(**params)
    except TypeError as exc:
        raise ConfigError(f"workload {args.workload}: {exc}") from None


def _slo(args: argparse.Namespace) -> SLO | None:
    """`--slo-ttft` / `--slo-tbt` as every request's SLO; None without either."""
    from quillcache.errors import ConfigError
    from quillcache.routing import SLO

    if args.slo_queue and (args.slo_ttft is None or args.no_admission):
        raise ConfigError("--slo-queue needs --slo-ttft and admission (no --no-admission)")
    if args.slo_ttft is None and args.slo_tbt is None:
        if args.no_admission:
            raise ConfigError("--no-admission needs an SLO (--slo-ttft or --slo-tbt)")
        return None
    for flag, v in (("--slo-ttft", args.slo_ttft), ("--slo-tbt", args.slo_tbt)):
        if v is not None and not (0 < v < math.inf):
            raise ConfigError(f"{flag} must be a positive number of seconds, got {v}")
    if args.timing != "full":
        raise ConfigError("an SLO needs --timing full (admission estimates queues)")
    return SLO(ttft_s=args.slo_ttft, tbt_s=args.slo_tbt)


# Forked workers read the workload from here instead of pickling it.
_SHARED: dict[str, Any] = {}


Point = tuple[str, str, int, int, int, str]  # router, backend, workers, capacity, replicas, state


def _run_point(point: Point) -> dict[str, Any]:
    from quillcache.sim.replicas import ReplicaConfig
    from quillcache.sim.runner import SimConfig, run

    router, backend, workers, capacity, replicas, state = point
    s = _SHARED
    config = SimConfig(
        workers=workers,
        max_num_seqs=s["engine_seqs"],
        capacity_blocks=capacity or None,
        cpu_blocks=s["cpu_blocks"],
        timing=s["timing"],
        seed=s["seed"],
        speculative=s["speculative"],
        dp_ranks=s["dp_ranks"],
        dp_placement=s["dp_placement"],
        replicate=s["replicate"],
        retain=s["retain"],
        slo=s["slo"],
        admission=s["admission"],
        slo_queue=s["slo_queue"],
    )
    res = run(
        s["workload"],
        router,
        backend,
        config,
        s["cost"],
        router_options=s["router_opts"].get(router),
        replicas=ReplicaConfig(replicas, state, s["lb"], s["scrape_interval_s"])
        if replicas
        else None,
    )
    if s["capacity_sweep"]:
        res.sweep["capacity_point"] = "unbounded" if capacity == UNBOUNDED else capacity
    return res.summary(perf=True)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from quillcache.errors import QuillCacheError

    err = Console(stderr=True)
    try:
        if args.matrix or args.out is not None or args.ray is not None:
            from quillcache.sim import matrix_cli

            matrix_cli.check_options(args, _defaults())
            return matrix_cli.run(args, err)
        return _run(args, err)
    except QuillCacheError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")  # messages may hold [brackets]
        return 2


def _run(args: argparse.Namespace, err: Any) -> int:
    from rich.markup import escape

    from quillcache.costmodel import CostModel, CostModelConfig
    from quillcache.errors import ConfigError
    from quillcache.index import backend_status
    from quillcache.routing import BUILTIN_ORDER, available_routers, create_router
    from quillcache.routing.registry import import_router, router_aliases
    from quillcache.sim.dp import check as check_dp

    if args.list_routers:
        aliases = router_aliases()
        for name in available_routers():
            if name in aliases:
                print(f"{name:20s} alias of {aliases[name]} (the same policy)")
                continue
            listed = create_router(name)
            print(f"{name:20s} {listed.summary}  [{listed.source}]")
        return 0
    _check_run_numbers(args)
    routers = list(BUILTIN_ORDER) if args.routers == "all" else args.routers.split(",")
    for r in routers:
        if ":" in r:  # a user's router class, as the gateway takes it
            import_router(r)
    known = set(available_routers())
    for r in routers:
        if r not in known:
            raise ConfigError(f"unknown router {r!r}; known: {', '.join(sorted(known))}")
    backends = args.backends.split(",")
    for b in backends:
        status = backend_status()
        if b not in status:
            raise ConfigError(f"unknown index backend {b!r}; known: {', '.join(status)}")
        if status[b] is not None:
            raise ConfigError(f"index backend {b!r} is unavailable: {status[b]}")
    router_opts: dict[str, dict[str, Any]] = {}
    for key, value in _kv(args.router_opt, "--router-opt").items():
        rname, dot, param = key.rpartition(".")
        if not dot or rname not in known:
            raise ConfigError(f"--router-opt needs ROUTER.KEY=VALUE with a known router: {key}")
        router_opts.setdefault(rname, {})[param] = value
    for rname, opts in router_opts.items():
        try:
            create_router(rname, **opts)  # fail fast on a bad option
        except TypeError as exc:
            raise ConfigError(f"--router-opt for {rname}: {exc}") from None

    config = CostModelConfig.load(args.cost_config) if args.cost_config else CostModelConfig()
    # An engine block size the user chose (file or flag) shapes the engines; the
    # default one yields to the workload's.
    chosen_bs = "block_size" in config.engine.model_fields_set
    if args.cost:
        overrides = _kv(args.cost, "--cost")
        chosen_bs = chosen_bs or "engine.block_size" in overrides
        config = config.with_overrides(overrides)
    if args.plot:
        from quillcache.plotting import pyplot

        pyplot()  # before the work: a missing extra is said at once
    workload = _workload(args)
    if not workload.requests:
        raise ConfigError("the workload has no requests")
    if args.open_loop:
        workload = workload.open_loop()
    if args.no_session_ids:
        workload = workload.without_sessions()
    if args.no_parent_hints:
        workload = workload.without_parent_hints()
    if args.time_scale != 1.0:
        workload = workload.scaled(args.time_scale)
    if chosen_bs:
        workload = workload.with_engine_blocks(config.engine.block_size)
    bs = workload.block_size
    config = config.with_overrides({"engine.block_size": bs})
    cost = CostModel(config)

    workers_list = _int_list(args.workers, "--workers")
    if args.capacity and args.capacity_tokens:
        raise ConfigError("give --capacity or --capacity-tokens, not both")
    if args.capacity:
        capacities = _int_list(args.capacity, "--capacity", allow_unbounded=True)
    elif args.capacity_tokens:
        tokens = _int_list(args.capacity_tokens, "--capacity-tokens", allow_unbounded=True)
        for c in tokens:
            if c != UNBOUNDED and c < bs:
                raise ConfigError(
                    f"--capacity-tokens {c} holds no whole block of {bs} tokens: an engine "
                    "could cache nothing and serve no request"
                )
        capacities = [c if c == UNBOUNDED else c // bs for c in tokens]
    else:
        capacities = [0]  # from the cost model
    replicas_list, states, lb, scrape_s = _replica_options(args)
    replicate = None
    if args.replicate or args.replicate_opt:
        from quillcache.sim.replicate import ReplicateSettings

        replicate = ReplicateSettings.parse(_kv(args.replicate_opt, "--replicate-opt"))
        if args.timing != "full":
            raise ConfigError("--replicate needs --timing full (replication acts on queues)")
    retain = None
    if args.retain or args.retain_opt:
        from quillcache.sim.retain import RetainSettings

        retain = RetainSettings.parse(_kv(args.retain_opt, "--retain-opt"))
        if args.timing != "full":
            raise ConfigError("--retain needs --timing full (retention acts on queues)")
        if replicas_list != [0]:
            raise ConfigError("--retain is simulated behind one gateway only (no --replicas)")
    slo = _slo(args)
    check_dp(args.dp_ranks, args.dp_placement)
    if args.dp_ranks > 1 and replicas_list != [0]:
        raise ConfigError("--dp-ranks > 1 is simulated behind one gateway only (no --replicas)")
    _SHARED.update(
        engine_seqs=_engine_seqs(args.engine_seqs),
        replicate=replicate,
        retain=retain,
        slo=slo,
        admission=not args.no_admission,
        slo_queue=args.slo_queue,
        dp_ranks=args.dp_ranks,
        dp_placement=args.dp_placement,
        lb=lb,
        scrape_interval_s=scrape_s,
        workload=workload,
        cost=cost,
        cpu_blocks=args.cpu_blocks,
        timing=args.timing,
        seed=args.seed,
        speculative=not args.no_speculative,
        router_opts=router_opts,
        capacity_sweep=len(capacities) > 1,
    )
    points: list[Point] = [
        (r, b, w, c, n, st)
        for c, w, st, n, b, r in itertools.product(
            capacities, workers_list, states, replicas_list, backends, routers
        )
    ]
    results = _execute(points, args, err, len(workload.requests))

    meta = {
        "workload": workload.name,
        "workload_params": workload.params,
        "requests": len(workload.requests),
        "block_size": bs,
        "timing": args.timing,
        "seed": args.seed,
        "cost_model": config.model_dump(),
    }
    if replicate is not None:
        meta["replicate"] = replicate.as_dict()
    if retain is not None:
        meta["retain"] = retain.as_dict()
    if slo is not None:
        meta["slo"] = {
            "ttft_s": slo.ttft_s,
            "tbt_s": slo.tbt_s,
            "admission": not args.no_admission,
            "queue": args.slo_queue,
        }
    if args.dp_ranks > 1:
        meta["dp"] = {"ranks": args.dp_ranks, "placement": args.dp_placement}
    if replicas_list != [0]:
        meta["replicas"] = {"lb": lb, "scrape_interval_s": scrape_s}
    warnings = _capacity_warnings(results, cost, bs, args.timing)
    if warnings:
        meta["warnings"] = warnings
    if args.json:
        shown = results if args.perf else [_deterministic(r) for r in results]
        text = json.dumps({"meta": meta, "results": shown}, indent=2, sort_keys=True)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as fh:
                fh.write(text + "\n")
    if args.json != "-":
        from quillcache.sim.report import table

        table(results, meta, sweep_workers=len(workers_list) > 1)
    if args.plot:
        from quillcache.sim.report import plot

        plot(results, args.plot, title=f"{workload.name}, {args.timing} timing")
        err.print(f"plot written to {args.plot}")
    for line in warnings:  # last, where a reader of the table sees them
        err.print(f"[yellow]warning:[/yellow] {escape(line)}", soft_wrap=True)
    return 0


def _capacity_warnings(
    results: list[dict[str, Any]], cost: Any, block_size: int, timing: str
) -> list[str]:
    """One line per capacity no GPU of the cost model can hold, in timed replay (an
    order-only replay is a cache analysis: any capacity, `unbounded` too, is a
    question it may ask)."""
    if timing != "full":
        return []
    out: list[str] = []
    for cap in dict.fromkeys(r["capacity_blocks"] for r in results if r["kv_exceeds_gpu"]):
        line = cost.kv_memory_warning(cap, block_size)
        if line is not None:
            out.append(line)
    return out


_PERF_KEYS = ("match_us_mean", "match_us_p99", "apply_us_mean", "apply_us_p99", "wall_s")


def _deterministic(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in _PERF_KEYS}


def _replica_options(args: argparse.Namespace) -> tuple[list[int], list[str], str, float]:
    """(replica counts, states, load balancer, scrape interval); counts [0]: one
    gateway, the plain simulator."""
    from quillcache.errors import ConfigError
    from quillcache.sim.replicas import ReplicaConfig

    if args.replicas is None:
        for flag, value in (
            ("--replica-state", args.replica_state),
            ("--lb", args.lb),
            ("--scrape-interval", args.scrape_interval),
        ):
            if value is not None:
                raise ConfigError(f"{flag} needs --replicas N")
        return [0], [""], "round-robin", 1.0
    counts = []
    for part in str(args.replicas).split(","):
        try:
            counts.append(int(part))
        except ValueError:
            raise ConfigError(f"--replicas: {part.strip()!r} is not a whole number") from None
    states = (args.replica_state or "shared").split(",")
    listed = (
        ("--replicas", args.replicas, counts),
        ("--replica-state", args.replica_state, [st.strip() for st in states]),
    )
    for flag, given, values in listed:
        if len(set(values)) < len(values):
            raise ConfigError(f"{flag} {given}: a value is listed twice")
    lb = args.lb or "round-robin"
    scrape = 1.0 if args.scrape_interval is None else args.scrape_interval
    for n in counts:
        for st in states:
            ReplicaConfig(n, st.strip(), lb, scrape).check()  # fail before any work
    return counts, [st.strip() for st in states], lb, scrape


def _execute(
    points: list[Point], args: argparse.Namespace, err: Any, n_req: int
) -> list[dict[str, Any]]:
    from rich.progress import Progress

    show = not args.no_progress and err.is_terminal
    results: list[dict[str, Any]] = []
    jobs = args.jobs
    if jobs < 0:
        from quillcache.errors import ConfigError

        raise ConfigError(f"--jobs must be >= 0 (0: one per CPU), got {jobs}")
    # Runs are independent and deterministic: results do not depend on the count.
    import multiprocessing as mp

    jobs = min(jobs or usable_cpus(), len(points))
    # fork: the workers inherit the loaded workload (_SHARED) instead of reloading or
    # unpickling it; without fork (Windows) the runs stay in this process.
    parallel = jobs > 1 and "fork" in mp.get_all_start_methods()
    done = 0
    with Progress(console=err, disable=not show, transient=True) as bar:
        task = bar.add_task("simulating", total=len(points))
        if parallel:
            # imap yields in the order of `points`: the output does not depend on jobs
            bar.update(task, description=f"{jobs} processes")
            with mp.get_context("fork").Pool(jobs) as pool:
                for res in pool.imap(_run_point, points):
                    results.append(res)
                    done += 1
                    bar.update(task, advance=1, description=f"{jobs} processes, {done} done")
        else:
            for point in points:
                bar.update(task, description=f"{point[0]} / {point[1]}")
                results.append(_run_point(point))
                bar.advance(task)
    return results


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask), at least 1."""
    import os

    counter = getattr(os, "process_cpu_count", None)  # Python >= 3.13
    if counter is not None:
        return counter() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="quillcache simulate")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
