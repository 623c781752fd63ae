//! Residency-index benchmarks on a serving-shaped workload (docs/index.md, "Numbers").
//!
//! Workload: 64 workers, block size 16; 256 system prompts of 8 blocks, each served
//! by a home set of 4 workers (prefix-affine routing); sessions of 8 turns x 8 blocks
//! on one worker of their prompt's home set, published as vLLM would (a turn stores
//! only its new blocks, chained to the previous turn's last hash; the first session
//! of a prompt on a worker also stores the prompt). Sessions are added until the
//! index holds 1 M blocks. Requests: the first 64 blocks of a random session.
//!
//!     cargo bench -p quillcache-core --bench index
//!
//! Besides criterion's means it prints p50/p99 of single matches and the memory per
//! resident (block, worker) pair.
//!
//! For profilers (`perf record`): with `QC_MATCH_ONLY=<seconds>` it builds the index
//! and only runs matches back to back for that long, then prints the mean time per
//! match; `QC_INTERLEAVED=1` builds it from the interleaved payload order instead.

mod common;
use common::{encode_stored, mix, thread_cpu_seconds, Rng};

use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

use criterion::{criterion_group, BatchSize, Criterion, Throughput};
use quillcache_core::content_key::chain_block;
use quillcache_core::index::{Index, PathLookup, SourceKey};
use quillcache_core::namespace::Namespace;

const WORKERS: u64 = 64;
const BS: usize = 16;
const PROMPTS: u64 = 256;
const SYS_BLOCKS: usize = 8;
const TURNS: usize = 8;
const TURN_BLOCKS: usize = 8;
const HOME: u64 = 4;
const TARGET_BLOCKS: usize = 1_000_000;
const REQUEST_BLOCKS: usize = 64;

struct Workload {
    payloads: Vec<(SourceKey, Vec<u8>)>,
    /// (session, turn) of each payload.
    origin: Vec<(u64, usize)>,
    blocks_stored: u64,
    requests: Vec<Vec<u64>>,
}

fn tokens_of(seed: u64, n_blocks: usize) -> Vec<u32> {
    (0..(n_blocks * BS) as u64)
        .map(|i| (mix(seed ^ (i << 40)) % 50_000) as u32)
        .collect()
}

fn workload() -> Workload {
    let mut rng = Rng(42);
    let root = Namespace {
        block_size: BS as u32,
        ..Default::default()
    }
    .id();
    // Keys of each system prompt (chained from the namespace).
    let sys: Vec<(Vec<u32>, Vec<u64>)> = (0..PROMPTS)
        .map(|p| {
            let toks = tokens_of(p, SYS_BLOCKS);
            let mut keys = vec![];
            let mut parent = root;
            for b in toks.chunks_exact(BS) {
                parent = chain_block(parent, b, None);
                keys.push(parent);
            }
            (toks, keys)
        })
        .collect();
    let engine_hash = |key: u64| mix(key ^ 0x5555);
    let mut has_prompt: HashSet<(u64, u64)> = HashSet::new();
    let mut payloads = vec![];
    let mut origin = vec![];
    let mut sessions: Vec<Vec<u64>> = vec![];
    let mut distinct = PROMPTS as usize * SYS_BLOCKS;
    let mut blocks_stored = 0u64;
    let mut s = 0u64;
    while distinct < TARGET_BLOCKS {
        let p = rng.next() % PROMPTS;
        let worker = (p * HOME + rng.next() % HOME) % WORKERS;
        let source = SourceKey { worker, dp_rank: 0 };
        let (sys_toks, sys_keys) = &sys[p as usize];
        let mut keys = sys_keys.clone();
        let toks = tokens_of(1 << 32 | s, TURNS * TURN_BLOCKS);
        for (t, turn) in toks.chunks_exact(TURN_BLOCKS * BS).enumerate() {
            let mut parent = *keys.last().unwrap();
            let mut new_keys = vec![];
            for b in turn.chunks_exact(BS) {
                parent = chain_block(parent, b, None);
                new_keys.push(parent);
            }
            let (hashes, parent_hash, tokens): (Vec<u64>, Option<u64>, Vec<u32>) =
                if t == 0 && has_prompt.insert((worker, p)) {
                    let all: Vec<u64> = sys_keys
                        .iter()
                        .chain(&new_keys)
                        .map(|&k| engine_hash(k))
                        .collect();
                    (all, None, [sys_toks.as_slice(), turn].concat())
                } else {
                    let parent_hash = engine_hash(*keys.last().unwrap());
                    (
                        new_keys.iter().map(|&k| engine_hash(k)).collect(),
                        Some(parent_hash),
                        turn.to_vec(),
                    )
                };
            blocks_stored += hashes.len() as u64;
            payloads.push((source, encode_stored(&hashes, parent_hash, &tokens, BS)));
            origin.push((s, t));
            keys.extend(new_keys);
        }
        distinct += TURNS * TURN_BLOCKS;
        sessions.push(keys);
        s += 1;
    }
    let requests = (0..4096)
        .map(|_| sessions[(rng.next() % sessions.len() as u64) as usize][..REQUEST_BLOCKS].to_vec())
        .collect();
    Workload {
        payloads,
        origin,
        blocks_stored,
        requests,
    }
}

/// The payloads as 64 concurrent sessions publish them: turn by turn, interleaved
/// (each session's own order kept). A request's blocks then come from 8 stores
/// separated by other sessions' blocks instead of one run of slab slots.
fn interleaved(w: &Workload) -> Vec<&(SourceKey, Vec<u8>)> {
    let mut order: Vec<usize> = (0..w.payloads.len()).collect();
    order.sort_by_key(|&i| {
        let (s, t) = w.origin[i];
        (s / 64, t, s)
    });
    order.into_iter().map(|i| &w.payloads[i]).collect()
}

/// One `apply_payloads` call per session (its 8 turns), as the Python benchmark
/// and a connector that drains its socket do.
fn build(w: &Workload) -> Index {
    build_into(Index::new(), w)
}

/// `build`, on an index pre-sized for the workload's blocks (`Index::reserve`).
fn build_reserved(w: &Workload) -> Index {
    let mut idx = Index::new();
    idx.reserve(TARGET_BLOCKS as u64).unwrap();
    build_into(idx, w)
}

/// The workload's payloads grouped by session (its 8 turns), with their source.
fn sessions(w: &Workload) -> Vec<(SourceKey, Vec<&[u8]>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < w.payloads.len() {
        let session = w.origin[i].0;
        let mut j = i;
        while j < w.payloads.len() && w.origin[j].0 == session {
            j += 1;
        }
        let call = w.payloads[i..j].iter().map(|(_, p)| p.as_slice()).collect();
        out.push((w.payloads[i].0, call));
        i = j;
    }
    out
}

fn build_into(mut idx: Index, w: &Workload) -> Index {
    for (source, call) in sessions(w) {
        idx.apply_payloads(source, &call).unwrap();
    }
    idx
}

/// `Index::apply_many` with 512 sessions per call on a reserved index: decoding on a
/// second thread while this one applies (a connector draining a full queue).
fn build_many_reserved(w: &Workload) -> Index {
    let mut idx = Index::new();
    idx.reserve(TARGET_BLOCKS as u64).unwrap();
    let idx = std::sync::Mutex::new(idx);
    for chunk in sessions(w).chunks(512) {
        Index::apply_many(chunk, || idx.lock().unwrap()).unwrap();
    }
    idx.into_inner().unwrap()
}

/// One `apply_payload` call per payload.
fn build_one_by_one(w: &Workload) -> Index {
    let mut idx = Index::new();
    for (source, payload) in &w.payloads {
        idx.apply_payload(*source, payload).unwrap();
    }
    idx
}

fn benches(c: &mut Criterion) {
    let w = workload();
    let mut g = c.benchmark_group("index");
    g.sample_size(10);
    g.throughput(Throughput::Elements(w.blocks_stored));
    g.bench_function("ingest_payloads_1M_blocks", |b| {
        b.iter_batched(|| (), |_| build(&w), BatchSize::PerIteration)
    });
    g.finish();

    let idx = build(&w);
    let mut g = c.benchmark_group("index");
    g.throughput(Throughput::Elements(1));
    let mut i = 0;
    g.bench_function("match_64_blocks_1M", |b| {
        b.iter(|| {
            i = (i + 1) % w.requests.len();
            black_box(idx.match_keys(black_box(&w.requests[i])))
        })
    });
    g.finish();
}

/// p50/p99 of single matches (each timed on its own; `Instant` adds a little) and memory.
fn percentiles() {
    let w = workload();
    let t0 = Instant::now();
    for (_, payload) in &w.payloads {
        black_box(quillcache_core::events::decode_batch(payload).unwrap());
    }
    let decode = t0.elapsed();
    // One payload per call, a session's payloads per call, and the same on an index
    // given its final size first: alternating, 3 passes each.
    let mut passes: [Vec<(f64, f64)>; 4] = [vec![], vec![], vec![], vec![]];
    let mut idx = Index::new();
    for round in 0..12 {
        drop(idx);
        let t0 = Instant::now();
        let cpu0 = thread_cpu_seconds();
        // The last pass is a plain `build`: its index is the one measured below.
        idx = match round % 4 {
            0 => build_one_by_one(&w),
            1 => build_reserved(&w),
            2 => build_many_reserved(&w),
            _ => build(&w),
        };
        let wall = t0.elapsed().as_secs_f64();
        let cpu = thread_cpu_seconds() - cpu0;
        passes[round % 4].push((wall, cpu));
    }
    let names = [
        "one payload per call",
        "a session's 8 payloads per call, reserve(1 M) first",
        "apply_many, 512 sessions per call, reserve(1 M) first (CPU: this thread only)",
        "a session's 8 payloads per call",
    ];
    for (name, p) in names.iter().zip(&passes) {
        let best_wall = p.iter().map(|x| x.0).fold(f64::MAX, f64::min);
        let best_cpu = p.iter().map(|x| x.1).fold(f64::MAX, f64::min);
        println!(
            "index/ingest, {name}: best of 3 passes {:.2} M blocks/s wall, {:.2} M blocks per CPU-second \
             (decoding alone {:?}; {} payloads, {} blocks)",
            w.blocks_stored as f64 / best_wall / 1e6,
            w.blocks_stored as f64 / best_cpu / 1e6,
            decode,
            w.payloads.len(),
            w.blocks_stored
        );
    }
    let st = idx.stats();
    print_regrow("index/regrow_1M", &idx);
    print_latency("index/match_64_blocks_1M", &idx, &w.requests);
    // Snapshot v4 writes nodes in key-table slot order, so a restored index has lost
    // the runs of consecutive slots that `match` walks: same answers, maybe slower.
    let mut image = Vec::new();
    idx.write_snapshot(&mut image).unwrap();
    let restored = Index::from_snapshot_bytes(&image).unwrap();
    drop(image);
    print_latency(
        "index/match_64_blocks_1M_after_snapshot",
        &restored,
        &w.requests,
    );
    drop(restored);
    let mut mixed = Index::new();
    for (source, payload) in interleaved(&w) {
        mixed.apply_payload(*source, payload).unwrap();
    }
    print_latency("index/match_64_blocks_1M_interleaved", &mixed, &w.requests);
    println!(
        "index memory: {} blocks, {} resident pairs, {} sources, {} bytes = {:.1} bytes/pair, {:.1} bytes/block",
        st.blocks,
        st.resident_pairs,
        st.sources,
        st.memory_bytes,
        st.memory_bytes as f64 / st.resident_pairs as f64,
        st.memory_bytes as f64 / st.blocks as f64
    );
}

/// The time of re-placing a full index's table entries in tables twice the size:
/// `reserve(2 × blocks)` on copies of `idx` (what each doubling during ingest does,
/// for the last and largest doubling), 7 times, min and median.
fn print_regrow(name: &str, idx: &Index) {
    let blocks = idx.stats().nodes;
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let mut copy = idx.clone();
            let t0 = Instant::now();
            copy.reserve(2 * blocks).unwrap();
            t0.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    println!(
        "{name}: reserve(2 x {blocks}) on a built index: min {:.1} ms, median {:.1} ms (7 copies)",
        times[0], times[3]
    );
}

/// p50/p99 of 200 000 single matches, each timed on its own, for `match_keys`
/// (runs first) and for the table-only lookup of the previous round, alternating
/// call by call so that the machine's noise hits both alike.
fn print_latency(name: &str, idx: &Index, requests: &[Vec<u64>]) {
    const N: usize = 200_000;
    let mut samples = [Vec::with_capacity(N), Vec::with_capacity(N)];
    let lookups = [PathLookup::Runs, PathLookup::Table];
    for round in 0..2 * N {
        let req = &requests[(round * 7919) % requests.len()];
        let which = round % 2;
        let t0 = Instant::now();
        black_box(idx.match_keys_using(black_box(req), lookups[which]));
        samples[which].push(t0.elapsed().as_nanos() as u64);
    }
    let hits: usize = requests.iter().map(|r| idx.match_keys(r).len()).sum();
    for (s, lookup) in samples.iter_mut().zip(lookups) {
        s.sort_unstable();
        let pct = |p: f64| s[((s.len() - 1) as f64 * p) as usize];
        println!(
            "{name} latency ({lookup:?}): p50 {} ns, p99 {} ns ({} samples, {:.1} holders matched per request)",
            pct(0.50),
            pct(0.99),
            s.len(),
            hits as f64 / requests.len() as f64
        );
    }
}

/// Matches back to back for `secs` seconds (`QC_MATCH_ONLY`), for profilers.
fn match_only(secs: f64) {
    let w = workload();
    let idx = if std::env::var_os("QC_INTERLEAVED").is_some() {
        let mut mixed = Index::new();
        for (source, payload) in interleaved(&w) {
            mixed.apply_payload(*source, payload).unwrap();
        }
        mixed
    } else {
        build(&w)
    };
    let t0 = Instant::now();
    let mut n = 0usize;
    while t0.elapsed().as_secs_f64() < secs {
        for r in 0..w.requests.len() {
            let req = &w.requests[(r * 7919) % w.requests.len()];
            black_box(idx.match_keys(black_box(req)));
        }
        n += w.requests.len();
    }
    println!(
        "index/match_64_blocks_1M back to back: {n} matches, mean {:.0} ns",
        t0.elapsed().as_secs_f64() * 1e9 / n as f64
    );
}

criterion_group!(index_benches, benches);

fn main() {
    if let Ok(secs) = std::env::var("QC_MATCH_ONLY") {
        match_only(secs.parse().expect("QC_MATCH_ONLY: seconds"));
        return;
    }
    index_benches();
    percentiles();
    Criterion::default().configure_from_args().final_summary();
}
