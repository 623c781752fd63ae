//! Engines come and go: the index's memory stays bounded (issue 15, part 3).
//!
//! A fleet of `n` engines fills the index (a system prompt every engine holds,
//! conversations held by 1-3 engines and growing turn by turn, some blocks offloaded
//! to CPU, every engine registered with its own model string); then engines are
//! removed and as many new ones (new worker ids) replay the same stores. The heap
//! accounting must come back within 1 % of its size before the churn, cycle after
//! cycle, and the parts that could leak without showing in the node count — the
//! spill arena of holder lists, the sources (slots, key map, interned model and
//! tokenizer strings) and the interned media — must not grow.

use crate::content_key::chain_keys;
use crate::events::{EventBatch, Medium};
use crate::namespace::Namespace;

use super::*;

use super::tests::{self, BS};
const SYS: u32 = 4;
/// Every engine serves the same model (so that they share the system prompt); each
/// source still keeps its own copy of the name, which goes with the source.
const MODEL: &str = "fleet-model-8b-instruct";
const TOKENIZER: &str = "fleet-tokenizer";

fn tokens(conv: u32, block: u32) -> Vec<u32> {
    (0..BS)
        .map(|t| conv.wrapping_mul(100_000).wrapping_add(block * BS + t))
        .collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, medium: Medium) -> EventBatch {
    tests::batch(vec![tests::stored(hashes, parent, tokens, medium)])
}

/// The engine hash of block `block` of conversation `conv` (the same on every
/// engine: vLLM's default hashing), `conv == u32::MAX` being the system prompt.
fn ehash(conv: u32, block: u32) -> u64 {
    (conv as u64) << 32 | block as u64 | 1 << 63
}

/// One engine's action, in fleet order.
enum Op {
    Register(String),
    Apply(EventBatch),
}

/// The load of a fleet of `n` engines (engine indexes `0..n`), in order: every engine
/// registers (model and tokenizer names) and stores the system prompt; `convs`
/// conversations, each on 1-3 engines, each turn stored by one of them (what it did
/// not hold yet, chained to what it held); every third conversation's blocks are
/// also offloaded to CPU by its first engine.
fn load(n: u32, convs: u32) -> Vec<(u32, Op)> {
    let mut ops = vec![];
    let sys_tokens: Vec<u32> = (0..SYS).flat_map(|b| tokens(u32::MAX / 2, b)).collect();
    let sys_hashes: Vec<u64> = (0..SYS).map(|b| ehash(u32::MAX, b)).collect();
    for e in 0..n {
        ops.push((e, Op::Register(MODEL.to_string())));
        ops.push((
            e,
            Op::Apply(stored(&sys_hashes, None, sys_tokens.clone(), Medium::Gpu)),
        ));
    }
    for c in 0..convs {
        let k = 1 + c % 3;
        let engines: Vec<u32> = (0..k).map(|j| (c * 7 + j * 13) % n).collect();
        let mut held = vec![SYS; k as usize];
        let mut len = SYS;
        for turn in 0..(1 + c % 5) {
            len += 2 + (c + turn) % 4;
            let at = (turn as usize + c as usize) % k as usize;
            let from = held[at];
            let hashes: Vec<u64> = (from..len).map(|b| ehash(c, b)).collect();
            let toks: Vec<u32> = (from..len).flat_map(|b| tokens(c, b)).collect();
            let parent = if from == SYS {
                ehash(u32::MAX, SYS - 1)
            } else {
                ehash(c, from - 1)
            };
            ops.push((
                engines[at],
                Op::Apply(stored(&hashes, Some(parent), toks, Medium::Gpu)),
            ));
            held[at] = len;
        }
        if c % 3 == 0 && held[0] > SYS {
            // An offload of what the first engine holds (no tokens: by hash).
            let hashes: Vec<u64> = (SYS..held[0]).map(|b| ehash(c, b)).collect();
            ops.push((
                engines[0],
                Op::Apply(stored(&hashes, None, vec![], Medium::Cpu)),
            ));
        }
    }
    ops
}

/// Applies the ops of engines `keep` as workers `base + e`.
fn apply(idx: &mut Index, ops: &[(u32, Op)], base: u64, keep: std::ops::Range<u32>) {
    for (e, op) in ops.iter().filter(|(e, _)| keep.contains(e)) {
        let source = SourceKey {
            worker: base + *e as u64,
            dp_rank: 0,
        };
        match op {
            Op::Register(model) => idx.register_source(source, model, TOKENIZER),
            Op::Apply(b) => {
                let s = idx.apply_batch(source, b);
                assert_eq!(s.orphan_blocks + s.invalid_events, 0);
            }
        }
    }
}

/// What must not grow: (memory_bytes, spill arena bytes, spilled lists, source
/// slots, bytes of the sources' names, interned media).
fn sizes(idx: &Index) -> (u64, usize, usize, usize, usize, usize) {
    let names = idx
        .sources
        .iter()
        .map(|(_, s)| s.model.capacity() + s.tokenizer.capacity())
        .sum();
    (
        idx.stats().memory_bytes,
        idx.tree.spills.heap_bytes(),
        idx.tree.spills.in_use(),
        idx.sources.slots.len(),
        names,
        idx.media.all().len(),
    )
}

/// A fleet of `n` engines; `cycles` times, its `removed` oldest engines go and as
/// many new ones (new worker ids) replay their stores.
fn churn(n: u32, removed: u32, convs: u32, cycles: u64) {
    let ops = load(n, convs);
    let mut idx = Index::new();
    apply(&mut idx, &ops, 0, 0..n);
    idx.check_invariants().unwrap();
    let first = idx.stats();
    let (mem0, spill0, lists0, slots0, names0, media0) = sizes(&idx);
    assert!(first.spilled > 100, "the load spills holder lists");
    let ns = Namespace {
        model: MODEL.into(),
        tokenizer: TOKENIZER.into(),
        block_size: BS,
        ..Default::default()
    };
    let mut sys_keys = vec![];
    let sys_tokens: Vec<u32> = (0..SYS).flat_map(|b| tokens(u32::MAX / 2, b)).collect();
    chain_keys(ns.id(), &sys_tokens, BS as usize, &mut sys_keys);
    // Engine e of the fleet is worker `base[e] + e`.
    let mut base = vec![0u64; n as usize];
    for cycle in 1..=cycles {
        // The engines that go this cycle: a window moving round the fleet.
        let first_gone = ((cycle - 1) * removed as u64 % n as u64) as u32;
        let gone: Vec<u32> = (0..removed).map(|i| (first_gone + i) % n).collect();
        for &e in &gone {
            idx.remove_worker(base[e as usize] + e as u64);
        }
        idx.check_invariants().unwrap();
        if removed == n {
            let st = idx.stats();
            assert_eq!((st.blocks, st.nodes, st.resident_pairs), (0, 0, 0));
            assert_eq!((st.sources, st.spilled), (0, 0));
        }
        // New engines (worker ids never seen) replay the removed engines' stores.
        for &e in &gone {
            base[e as usize] = cycle * n as u64;
        }
        for &e in &gone {
            apply(&mut idx, &ops, base[e as usize], e..e + 1);
        }
        idx.check_invariants().unwrap();
        let st = idx.stats();
        assert_eq!(
            (
                st.blocks,
                st.nodes,
                st.resident_pairs,
                st.sources,
                st.spilled
            ),
            (
                first.blocks,
                first.nodes,
                first.resident_pairs,
                first.sources,
                first.spilled
            ),
            "cycle {cycle}: the same load gives the same index"
        );
        let (mem, spill, lists, slots, names, media) = sizes(&idx);
        assert!(
            (mem as f64 - mem0 as f64).abs() <= mem0 as f64 * 0.01,
            "cycle {cycle}: memory_bytes {mem} vs {mem0} before the churn ({:+.2} %)",
            (mem as f64 / mem0 as f64 - 1.0) * 100.0
        );
        assert!(
            spill <= spill0,
            "cycle {cycle}: spill arena {spill} B, {spill0} B before"
        );
        assert_eq!(lists, lists0, "cycle {cycle}: spilled lists");
        assert_eq!(slots, slots0, "cycle {cycle}: source slots");
        assert_eq!(names, names0, "cycle {cycle}: bytes of source names");
        assert_eq!(media, media0, "cycle {cycle}: interned media");
        // Every engine of the fleet still matches the whole system prompt.
        let hits = idx.match_keys(&sys_keys);
        assert_eq!(hits.len(), n as usize);
        assert!(hits.iter().all(|h| h.blocks == SYS));
    }
}

#[test]
fn memory_returns_after_replacing_most_engines() {
    // The shape at test size: 1,000 of 1,024 engines replaced, twice.
    churn(1024, 1000, 3_000, 2);
}

#[test]
fn memory_returns_after_replacing_every_engine() {
    churn(64, 64, 5_000, 4);
}

#[test]
fn memory_returns_after_replacing_a_few_engines_many_times() {
    churn(32, 3, 3_000, 12);
}
