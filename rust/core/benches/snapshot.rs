//! Snapshot write/load of a 1 M-block index (docs/persistence.md, "Recovery").
//!
//! Builds a serving-shaped index (8 workers, 512 shared system prompts of 8 blocks,
//! sessions of 64 blocks chained under them, each stored by one worker, some also
//! offloaded to a second medium) until it holds 1 M nodes, then times
//! `write_snapshot` and `read_snapshot` (best of 5, and p50).
//!
//!     cargo bench -p quillcache-core --bench snapshot
//!
//! For instruction counts under load: `QC_SNAPSHOT_ROUNDS=1 valgrind --tool=callgrind
//! target/release/deps/snapshot-*`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use quillcache_core::index::{Index, SourceKey};

const WORKERS: u64 = 8;
const PROMPTS: u64 = 512;
const SYS_BLOCKS: usize = 8;
const SESSION_BLOCKS: usize = 64;
const TARGET_NODES: u64 = 1_000_000;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

/// One BlockStored batch in vLLM's array form (no tokens: hashes chained by the engine).
fn stored(hashes: &[u64], parent: Option<u64>, medium: &str) -> Vec<u8> {
    use rmp::encode::*;
    let mut w = Vec::with_capacity(64 + hashes.len() * 9);
    write_array_len(&mut w, 3).unwrap();
    write_f64(&mut w, 1.0).unwrap();
    write_array_len(&mut w, 1).unwrap();
    write_array_len(&mut w, 8).unwrap();
    write_str(&mut w, "BlockStored").unwrap();
    write_array_len(&mut w, hashes.len() as u32).unwrap();
    for &h in hashes {
        write_u64(&mut w, h).unwrap();
    }
    match parent {
        Some(p) => write_u64(&mut w, p).unwrap(),
        None => write_nil(&mut w).unwrap(),
    }
    write_array_len(&mut w, hashes.len() as u32 * 16).unwrap();
    // Each block's tokens derive from its engine hash: equal hashes, equal content.
    for &h in hashes {
        for i in 0..16 {
            write_uint(&mut w, mix(h ^ i) % 50_000).unwrap();
        }
    }
    write_uint(&mut w, 16).unwrap();
    write_nil(&mut w).unwrap();
    write_str(&mut w, medium).unwrap();
    write_nil(&mut w).unwrap();
    write_uint(&mut w, 0).unwrap();
    w
}

fn build() -> Index {
    let mut idx = Index::new();
    let mut rng = 7u64;
    let mut next = || {
        rng = rng.wrapping_add(0x9e3779b97f4a7c15);
        mix(rng)
    };
    let mut session = 0u64;
    // `stats()` sums heap sizes (O(index)): check it once per 1,024 sessions.
    while !session.is_multiple_of(1024) || idx.stats().nodes < TARGET_NODES {
        let p = next() % PROMPTS;
        let worker = next() % WORKERS;
        let source = SourceKey { worker, dp_rank: 0 };
        let sys: Vec<u64> = (0..SYS_BLOCKS as u64)
            .map(|b| mix(p << 8 | b) | 1)
            .collect();
        let own: Vec<u64> = (0..SESSION_BLOCKS as u64)
            .map(|b| mix(session << 20 | b | 1 << 63))
            .collect();
        let all: Vec<u64> = sys.iter().chain(&own).copied().collect();
        idx.apply_payload(source, &stored(&all, None, "GPU"))
            .unwrap();
        if session.is_multiple_of(4) {
            idx.apply_payload(source, &stored(&all[..SYS_BLOCKS + 8], None, "CPU"))
                .unwrap();
        }
        session += 1;
    }
    idx
}

fn main() {
    let rounds: usize = std::env::var("QC_SNAPSHOT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let t = Instant::now();
    let idx = build();
    let stats = idx.stats();
    println!(
        "built {} nodes, {} blocks, {} pairs in {:?}",
        stats.nodes,
        stats.blocks,
        stats.resident_pairs,
        t.elapsed()
    );
    let mut image = Vec::new();
    let mut writes = vec![];
    for _ in 0..rounds {
        image.clear();
        let t = Instant::now();
        idx.write_snapshot(&mut image).unwrap();
        writes.push(t.elapsed());
    }
    let mut reads = vec![];
    for _ in 0..rounds {
        let t = Instant::now();
        let back = Index::from_snapshot_bytes(&image).unwrap();
        reads.push(t.elapsed());
        black_box(back);
    }
    let show = |name: &str, mut v: Vec<Duration>| {
        v.sort();
        println!(
            "{name}: best {:?}, p50 {:?} ({} rounds)",
            v[0],
            v[v.len() / 2],
            v.len()
        );
    };
    println!(
        "image: {} bytes ({:.1} B/node)",
        image.len(),
        image.len() as f64 / stats.nodes as f64
    );
    show("write_snapshot", writes);
    show("read_snapshot", reads);
}
