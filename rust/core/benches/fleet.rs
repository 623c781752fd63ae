//! The residency index at fleet size (docs/index.md, "At fleet size"; issue 15 part 3).
//!
//! Workload (`QC_FLEET_BLOCKS`, default 10 M, is the number of distinct blocks):
//!
//! * 1,024 engines (one DP rank each), block size 16, vLLM's hashing on every engine
//!   (the same engine hash for the same content, as vLLM with the default seed).
//! * A system prompt of 8 blocks that every engine holds (each engine stores it
//!   first, from block 0).
//! * Conversations: 1-12 turns (uniform), each turn adding 2-10 blocks (uniform),
//!   chained under the system prompt. Each has a home set of 1 engine (60 %), 2 (30 %)
//!   or 3 (10 %); turn 0 runs on the first, every later turn on one of the set at
//!   random. An engine serving a turn stores what it did not hold yet (the whole
//!   history after the system prompt if the conversation is new to it, else the
//!   blocks since its last turn), chained to the last block it held, as vLLM
//!   publishes. No eviction: the index ends with `QC_FLEET_BLOCKS` distinct blocks.
//! * Time order: conversations run in waves of 8,192 at once (8 per engine); a wave's
//!   turn t is one `apply_many` call with one item per engine (its turns of that step,
//!   ~8 payloads): every call carries all 1,024 sources, interleaved as a connector
//!   draining 1,024 sockets sees them, and a conversation's blocks come from several
//!   stores separated by other conversations' blocks.
//! * A match request: a random conversation's whole history (system prompt included)
//!   plus 4 blocks of a next turn that nobody holds. Every request matches the 1,024
//!   engines holding the system prompt: ~1,025 hits per match.
//!
//! Phases, each printed on its own line: ingest (wall and CPU, blocks/s), match
//! p50/p99 (each match timed on its own; `match_keys` and `match_compact`
//! alternated on the same requests, or one of them alone with
//! `QC_FLEET_MATCH=full|compact`), memory (IndexStats::memory_bytes and the
//! process RSS growth, per resident pair and per block), churn (remove 1,000 engines,
//! then 1,000 new ones replay the removed engines' stores: each removal's time, p50,
//! p99 and max; memory_bytes before, after removal, after re-adding), and native-wal (the same stream through `DurableIndex`,
//! then `snapshot()` and a reopen: write and restore times).
//!
//!     cargo bench -p quillcache-core --bench fleet
//!     QC_FLEET_BLOCKS=1000000 QC_FLEET_PHASES=ingest,match cargo bench -p quillcache-core --bench fleet
//!
//! `QC_FLEET_PHASES` (default `ingest,match,memory,churn,wal`) picks phases; `ingest`,
//! `match` and `memory` share one built index.

mod common;
use common::{encode_stored, mix, thread_cpu_seconds, Rng};

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use quillcache_core::content_key::chain_block;
use quillcache_core::index::{Index, SourceKey};
use quillcache_core::namespace::Namespace;
use quillcache_core::persist::{DurableIndex, DurableOptions};

const ENGINES: u64 = 1024;
const BS: usize = 16;
const SYS_BLOCKS: usize = 8;
const WAVE: usize = 8192;
const NEW_BLOCKS: usize = 4;
/// Every this many conversations, one is kept for match requests.
const SAMPLE_EVERY: u64 = 64;
const REMOVED: u64 = 1000;

/// vLLM's hash of a block, the same on every engine (default seed).
fn engine_hash(key: u64) -> u64 {
    mix(key ^ 0x5555)
}

/// The tokens of block `block` of conversation `conv` (`u64::MAX`: the system prompt).
fn block_tokens(conv: u64, block: usize, out: &mut Vec<u32>) {
    let seed = mix(conv.wrapping_mul(0x1000_0000_01b3) ^ (block as u64) << 48);
    out.extend((0..BS as u64).map(|i| (mix(seed ^ i) % 50_000) as u32));
}

struct Conv {
    id: u64,
    engines: [u64; 3],
    k: usize,
    /// Blocks added by each turn.
    turns: Vec<u8>,
    /// Content keys so far (system prompt included).
    keys: Vec<u64>,
    /// Blocks each home engine holds (0: none yet).
    held: [usize; 3],
}

/// One `apply_many` call: an item per engine.
type Call = Vec<(SourceKey, Vec<Vec<u8>>)>;

struct Generated {
    distinct_blocks: u64,
    blocks_stored: u64,
    payloads: u64,
    calls: u64,
    /// Match requests (a sample of conversations).
    requests: Vec<Vec<u64>>,
}

/// Generates the workload and hands it over call by call (so that it never sits in
/// memory whole: the RSS measured is the index's). `engine_of` maps each engine (or
/// drops its stores: None), for the churn phase's replay.
fn generate(
    target_blocks: u64,
    engine_of: impl Fn(u64) -> Option<u64>,
    mut sink: impl FnMut(&Call),
) -> Generated {
    let mut rng = Rng(15);
    let root = Namespace {
        block_size: BS as u32,
        ..Default::default()
    }
    .id();
    let mut toks = Vec::new();
    let mut sys_keys = Vec::with_capacity(SYS_BLOCKS);
    let mut sys_tokens = Vec::new();
    let mut parent = root;
    for b in 0..SYS_BLOCKS {
        toks.clear();
        block_tokens(u64::MAX, b, &mut toks);
        parent = chain_block(parent, &toks, None);
        sys_keys.push(parent);
        sys_tokens.extend_from_slice(&toks);
    }
    let sys_hashes: Vec<u64> = sys_keys.iter().map(|&k| engine_hash(k)).collect();
    let mut out = Generated {
        distinct_blocks: SYS_BLOCKS as u64,
        blocks_stored: 0,
        payloads: 0,
        calls: 0,
        requests: Vec::new(),
    };
    let mut emit = |call: &mut Vec<(u64, Vec<u8>)>, out: &mut Generated| {
        // Group by engine, keeping each engine's order.
        call.sort_by_key(|(e, _)| *e);
        let mut grouped: Call = Vec::new();
        for (e, p) in call.drain(..) {
            let Some(worker) = engine_of(e) else {
                continue;
            };
            out.payloads += 1;
            match grouped.last_mut() {
                Some((s, ps)) if s.worker == worker => ps.push(p),
                _ => grouped.push((SourceKey { worker, dp_rank: 0 }, vec![p])),
            }
        }
        if !grouped.is_empty() {
            out.calls += 1;
            sink(&grouped);
        }
    };
    // Every engine stores the system prompt first.
    let mut call: Vec<(u64, Vec<u8>)> = (0..ENGINES)
        .map(|e| (e, encode_stored(&sys_hashes, None, &sys_tokens, BS)))
        .collect();
    out.blocks_stored += SYS_BLOCKS as u64 * ENGINES;
    emit(&mut call, &mut out);

    let mut next_conv = 0u64;
    let mut hashes = Vec::new();
    while out.distinct_blocks < target_blocks {
        // A wave of conversations, planned so that the total is reached exactly-ish.
        let mut wave: Vec<Conv> = Vec::with_capacity(WAVE);
        while wave.len() < WAVE && out.distinct_blocks < target_blocks {
            let k = match rng.below(10) {
                0..=5 => 1,
                6..=8 => 2,
                _ => 3,
            };
            let mut engines = [0u64; 3];
            for i in 0..k {
                loop {
                    let e = rng.below(ENGINES);
                    if !engines[..i].contains(&e) {
                        engines[i] = e;
                        break;
                    }
                }
            }
            let n_turns = 1 + rng.below(12) as usize;
            let turns: Vec<u8> = (0..n_turns).map(|_| 2 + rng.below(9) as u8).collect();
            out.distinct_blocks += turns.iter().map(|&t| t as u64).sum::<u64>();
            let mut keys = Vec::with_capacity(SYS_BLOCKS + turns.len() * 10);
            keys.extend_from_slice(&sys_keys);
            wave.push(Conv {
                id: next_conv,
                engines,
                k,
                turns,
                keys,
                held: [0; 3],
            });
            next_conv += 1;
        }
        let max_turns = wave.iter().map(|c| c.turns.len()).max().unwrap_or(0);
        for t in 0..max_turns {
            for c in wave.iter_mut().filter(|c| c.turns.len() > t) {
                let slot = if t == 0 {
                    0
                } else {
                    rng.below(c.k as u64) as usize
                };
                let e = c.engines[slot];
                // The turn's new blocks.
                let mut parent = *c.keys.last().unwrap();
                for _ in 0..c.turns[t] {
                    toks.clear();
                    block_tokens(c.id, c.keys.len(), &mut toks);
                    parent = chain_block(parent, &toks, None);
                    c.keys.push(parent);
                }
                // What this engine stores: everything after what it holds.
                let from = c.held[slot].max(SYS_BLOCKS);
                let to = c.keys.len();
                c.held[slot] = to;
                hashes.clear();
                hashes.extend(c.keys[from..to].iter().map(|&k| engine_hash(k)));
                toks.clear();
                for b in from..to {
                    block_tokens(c.id, b, &mut toks);
                }
                out.blocks_stored += (to - from) as u64;
                let parent_hash = engine_hash(c.keys[from - 1]);
                call.push((e, encode_stored(&hashes, Some(parent_hash), &toks, BS)));
            }
            emit(&mut call, &mut out);
        }
        for c in wave.iter().filter(|c| c.id % SAMPLE_EVERY == 0) {
            let mut req = c.keys.clone();
            let mut parent = *req.last().unwrap();
            for b in 0..NEW_BLOCKS {
                toks.clear();
                block_tokens(c.id ^ 0xdead_beef, b, &mut toks);
                parent = chain_block(parent, &toks, None);
                req.push(parent);
            }
            out.requests.push(req);
        }
    }
    out
}

/// Resident set size of this process, bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn mb(b: u64) -> f64 {
    b as f64 / 1e6
}

/// Builds the index from the whole stream with `apply_many`: (index, workload, wall
/// seconds and CPU seconds spent in `apply_many` only).
fn build(target: u64) -> (Index, Generated, f64, f64) {
    let idx = Mutex::new(Index::new());
    let mut wall = Duration::ZERO;
    let mut cpu = 0.0;
    let g = generate(target, Some, |call| {
        let c0 = thread_cpu_seconds();
        let t0 = Instant::now();
        Index::apply_many(call, || idx.lock().unwrap()).unwrap();
        wall += t0.elapsed();
        cpu += thread_cpu_seconds() - c0;
    });
    (idx.into_inner().unwrap(), g, wall.as_secs_f64(), cpu)
}

fn print_match(idx: &Index, requests: &[Vec<u64>]) {
    const N: usize = 200_000;
    // The full match and the compact one on the same requests, alternated (which
    // goes first too), so that both see the same caches and the same host.
    // `QC_FLEET_MATCH=full` or `compact` times only that one (each then runs with
    // the caches it leaves itself, as a router calling only it would).
    let only = std::env::var("QC_FLEET_MATCH").unwrap_or_default();
    let mut full = Vec::with_capacity(N);
    let mut compact = Vec::with_capacity(N);
    for round in 0..N {
        let req = &requests[(round * 7919) % requests.len()];
        for k in 0..2 {
            let use_full = match only.as_str() {
                "full" => true,
                "compact" => false,
                _ => (round + k) % 2 == 0,
            };
            let t0 = Instant::now();
            if use_full {
                black_box(idx.match_keys(black_box(req)));
                full.push(t0.elapsed().as_nanos() as u64);
            } else {
                black_box(idx.match_compact(black_box(req)));
                compact.push(t0.elapsed().as_nanos() as u64);
            }
        }
    }
    let hits: usize = requests.iter().map(|r| idx.match_keys(r).len()).sum();
    let compact_hits: usize = requests
        .iter()
        .map(|r| idx.match_compact(r).hits.len())
        .sum();
    let floors: usize = requests
        .iter()
        .map(|r| idx.match_compact(r).floors.len())
        .sum();
    let blocks: usize = requests.iter().map(|r| r.len()).sum();
    let n = requests.len() as f64;
    for (name, samples, per_request) in [
        ("match", &mut full, format!("{:.1} hits", hits as f64 / n)),
        (
            "match_compact",
            &mut compact,
            format!(
                "{:.1} hits and {:.2} floors",
                compact_hits as f64 / n,
                floors as f64 / n
            ),
        ),
    ] {
        if samples.is_empty() {
            continue;
        }
        samples.sort_unstable();
        let pct = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize];
        println!(
            "fleet/{name}: p50 {} ns, p90 {} ns, p99 {} ns, p99.9 {} ns ({} samples over {} requests of {:.1} blocks, {per_request} per request)",
            pct(0.50),
            pct(0.90),
            pct(0.99),
            pct(0.999),
            samples.len(),
            requests.len(),
            blocks as f64 / n,
        );
    }
}

fn print_memory(idx: &Index, rss_growth: u64) {
    let st = idx.stats();
    println!(
        "fleet/memory: {} blocks, {} nodes, {} resident pairs, {} sources, {} spilled; memory_bytes {:.1} MB = {:.1} B/pair, {:.1} B/block; RSS growth {:.1} MB = {:.1} B/pair, {:.1} B/block",
        st.blocks,
        st.nodes,
        st.resident_pairs,
        st.sources,
        st.spilled,
        mb(st.memory_bytes),
        st.memory_bytes as f64 / st.resident_pairs as f64,
        st.memory_bytes as f64 / st.blocks as f64,
        mb(rss_growth),
        rss_growth as f64 / st.resident_pairs as f64,
        rss_growth as f64 / st.blocks as f64,
    );
}

/// Remove `REMOVED` engines, then replay their stores under new worker ids.
fn churn(idx: &mut Index, target: u64) {
    let before = idx.stats();
    let t0 = Instant::now();
    let mut dropped = 0;
    // Each removal timed on its own: it holds the index's write lock, so its worst
    // case is a stall of every routing decision.
    let mut each = Vec::with_capacity(REMOVED as usize);
    for w in 0..REMOVED {
        let t = Instant::now();
        dropped += idx.remove_worker(w);
        each.push(t.elapsed());
    }
    let remove_s = t0.elapsed().as_secs_f64();
    each.sort_unstable();
    let at = |q: f64| each[((each.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    println!(
        "fleet/churn: remove_worker each: p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        at(0.5),
        at(0.99),
        at(1.0)
    );
    let removed = idx.stats();
    let idx_cell = Mutex::new(std::mem::take(idx));
    let t0 = Instant::now();
    generate(
        target,
        |e| (e < REMOVED).then_some(e + ENGINES),
        |call| {
            Index::apply_many(call, || idx_cell.lock().unwrap()).unwrap();
        },
    );
    let readd_s = t0.elapsed().as_secs_f64();
    *idx = idx_cell.into_inner().unwrap();
    let after = idx.stats();
    idx.check_invariants().unwrap();
    println!(
        "fleet/churn: remove {REMOVED} engines ({dropped} pairs) in {remove_s:.1} s, re-add {REMOVED} new ones with the same stores in {readd_s:.1} s (generation included)"
    );
    for (name, st) in [
        ("before", before),
        ("after removal", removed),
        ("after re-adding", after),
    ] {
        println!(
            "fleet/churn {name}: memory_bytes {:.1} MB, nodes {}, pairs {}, sources {}, spilled {}",
            mb(st.memory_bytes),
            st.nodes,
            st.resident_pairs,
            st.sources,
            st.spilled
        );
    }
    println!(
        "fleet/churn: memory_bytes after / before = {:.4} ({:+.2} %)",
        after.memory_bytes as f64 / before.memory_bytes as f64,
        (after.memory_bytes as f64 / before.memory_bytes as f64 - 1.0) * 100.0
    );
}

fn wal(target: u64) {
    let dir = std::env::temp_dir().join(format!("qc-fleet-wal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let opts = DurableOptions {
        wal: quillcache_core::persist::wal::WalOptions {
            durability: quillcache_core::persist::wal::Durability::None,
            ..Default::default()
        },
        snapshot_every_bytes: 0,
        snapshot_log_ratio: 0.0,
        snapshot_every: None,
        snapshot_in_background: false,
        snapshot_on_close: false,
    };
    let mut d = DurableIndex::open(&dir, opts.clone()).unwrap();
    let mut wall = Duration::ZERO;
    let g = generate(target, Some, |call| {
        let t0 = Instant::now();
        for (source, payloads) in call {
            let refs: Vec<&[u8]> = payloads.iter().map(|p| p.as_slice()).collect();
            d.apply(*source, &refs, None).unwrap();
        }
        wall += t0.elapsed();
    });
    let st = d.index().stats();
    println!(
        "fleet/native-wal ingest: {:.2} M blocks/s wall ({} blocks stored, {} nodes, durability none)",
        g.blocks_stored as f64 / wall.as_secs_f64() / 1e6,
        g.blocks_stored,
        st.nodes
    );
    let mut writes = vec![];
    let mut restores = vec![];
    let mut loads = vec![];
    let mut bytes = 0;
    for round in 0..3 {
        if round > 0 {
            // Something new to cover, so that snapshot() writes again.
            d.register_source(
                SourceKey {
                    worker: 1 << 40 | round,
                    dp_rank: 0,
                },
                "m",
                "t",
            )
            .unwrap();
        }
        let t0 = Instant::now();
        d.snapshot().unwrap();
        writes.push(t0.elapsed().as_secs_f64());
        bytes = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("snap"))
            .map(|e| e.metadata().map_or(0, |m| m.len()))
            .sum();
        d.close().unwrap();
        let t0 = Instant::now();
        d = DurableIndex::open(&dir, opts.clone()).unwrap();
        restores.push(t0.elapsed().as_secs_f64());
        loads.push(d.recovery().snapshot_load.as_secs_f64());
        assert_eq!(d.index().stats().nodes, st.nodes);
    }
    println!(
        "fleet/native-wal snapshot: write {:?} s, restore (open) {:?} s, of which snapshot load {:?} s; snapshot {:.1} MB",
        writes.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
        restores.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
        loads.iter().map(|x| (x * 1000.0).round() / 1000.0).collect::<Vec<_>>(),
        mb(bytes)
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

fn main() {
    // `cargo bench` passes --bench; a plain `cargo test --benches` run passes nothing
    // and must stay quick.
    if !std::env::args().any(|a| a == "--bench") {
        println!("fleet: run with `cargo bench -p quillcache-core --bench fleet`");
        return;
    }
    let target: u64 = std::env::var("QC_FLEET_BLOCKS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000_000);
    let phases = std::env::var("QC_FLEET_PHASES").unwrap_or("ingest,match,memory,churn,wal".into());
    let on = |p: &str| phases.split(',').any(|x| x == p);
    println!("fleet: {target} distinct blocks over {ENGINES} engines; phases {phases}");
    if on("ingest") || on("match") || on("memory") || on("churn") {
        let rss0 = rss_bytes();
        let t0 = Instant::now();
        let (mut idx, g, wall, cpu) = build(target);
        let total = t0.elapsed().as_secs_f64();
        let rss_growth = rss_bytes().saturating_sub(rss0);
        println!(
            "fleet/ingest apply_many: {:.2} M blocks/s wall, {:.2} M blocks per CPU-second of the calling thread ({} blocks stored in {} payloads, {} calls of ~{} sources; {:.1} s in apply_many, {:.1} s with generation)",
            g.blocks_stored as f64 / wall / 1e6,
            g.blocks_stored as f64 / cpu / 1e6,
            g.blocks_stored,
            g.payloads,
            g.calls,
            ENGINES,
            wall,
            total
        );
        if on("memory") {
            print_memory(&idx, rss_growth);
        }
        if on("match") {
            print_match(&idx, &g.requests);
        }
        if on("churn") {
            churn(&mut idx, target);
        }
    }
    if on("wal") {
        wal(target);
    }
}
