//! Unit tests and property tests of the index, driven by decoded `EventBatch`es.

use proptest::prelude::*;

use crate::content_key::chain_keys;
use crate::events::{
    BlockRemoved, BlockStored, Event, EventBatch, ExtraKey, Medium, KNOWN_MEDIA, MAX_CUSTOM_MEDIA,
    OTHER_MEDIUM,
};
use crate::namespace::Namespace;

use super::*;

pub(super) const BS: u32 = 4;

fn src(worker: u64) -> SourceKey {
    SourceKey { worker, dp_rank: 0 }
}

pub(super) fn stored(
    hashes: &[u64],
    parent: Option<u64>,
    tokens: Vec<u32>,
    medium: Medium,
) -> Event {
    Event::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: tokens,
        block_size: BS,
        lora_id: None,
        medium,
        lora_name: None,
        extra_keys: vec![],
        group_idx: 0,
        cache_salt: None,
    })
}

fn removed(hashes: &[u64], medium: Medium) -> Event {
    Event::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: 0,
    })
}

pub(super) fn batch(events: Vec<Event>) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events,
        dp_rank: None,
    }
}

fn keys_of(tokens: &[u32]) -> Vec<u64> {
    let ns = Namespace {
        block_size: BS,
        ..Default::default()
    };
    let mut out = vec![];
    chain_keys(ns.id(), tokens, BS as usize, &mut out);
    out
}

fn toks(n_blocks: u32, salt: u32) -> Vec<u32> {
    (0..n_blocks * BS).map(|t| t + salt * 1000).collect()
}

#[test]
fn store_match_remove_roundtrip() {
    let mut idx = Index::new();
    let t = toks(3, 0);
    let s = idx.apply_batch(
        src(1),
        &batch(vec![stored(&[11, 12, 13], None, t.clone(), Medium::Gpu)]),
    );
    assert_eq!(s.blocks_stored, 3);
    let keys = keys_of(&t);
    let hits = idx.match_keys(&keys);
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].worker, hits[0].blocks), (1, 3));
    assert_eq!(idx.medium_name(hits[0].medium), "GPU");
    let s = idx.apply_batch(src(1), &batch(vec![removed(&[13], Medium::Gpu)]));
    assert_eq!(s.blocks_removed, 1);
    assert_eq!(idx.match_keys(&keys)[0].blocks, 2);
    idx.apply_batch(src(1), &batch(vec![removed(&[11, 12], Medium::Gpu)]));
    assert!(idx.match_keys(&keys).is_empty());
    assert_eq!(idx.stats().nodes, 0);
    idx.check_invariants().unwrap();
}

#[test]
fn parent_chain_duplicates_and_orphans() {
    let mut idx = Index::new();
    let t = toks(4, 0);
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2], None, t[..8].to_vec(), Medium::Gpu)]),
    );
    // Continues from hash 2; stored twice (vLLM physical copies).
    let cont = stored(&[3, 4], Some(2), t[8..].to_vec(), Medium::Gpu);
    idx.apply_batch(src(1), &batch(vec![cont.clone(), cont]));
    let keys = keys_of(&t);
    assert_eq!(idx.match_keys(&keys)[0].blocks, 4);
    idx.apply_batch(src(1), &batch(vec![removed(&[4], Medium::Gpu)]));
    assert_eq!(idx.match_keys(&keys)[0].blocks, 4, "one copy left");
    idx.apply_batch(src(1), &batch(vec![removed(&[4], Medium::Gpu)]));
    assert_eq!(idx.match_keys(&keys)[0].blocks, 3);
    let s = idx.apply_batch(src(1), &batch(vec![removed(&[4], Medium::Gpu)]));
    assert_eq!(s.unknown_removals, 1);
    // Unknown parent: orphans, not indexed.
    let s = idx.apply_batch(
        src(2),
        &batch(vec![stored(&[7], Some(99), t[..4].to_vec(), Medium::Gpu)]),
    );
    assert_eq!((s.orphan_blocks, s.blocks_stored), (1, 0));
    idx.check_invariants().unwrap();
}

#[test]
fn tokenless_store_resolves_through_the_engine_map() {
    let mut idx = Index::new();
    let t = toks(2, 0);
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2], None, t.clone(), Medium::Gpu)]),
    );
    let s = idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2, 3], None, vec![], Medium::Cpu)]),
    );
    assert_eq!((s.blocks_stored, s.orphan_blocks), (2, 1));
    let hits = idx.match_keys(&keys_of(&t));
    let media: Vec<&str> = hits.iter().map(|h| idx.medium_name(h.medium)).collect();
    assert_eq!(media, vec!["CPU", "GPU"]);
    // GPU copies evicted: the CPU tier still holds them, the hash mapping stays.
    idx.apply_batch(src(1), &batch(vec![removed(&[1, 2], Medium::Gpu)]));
    let hits = idx.match_keys(&keys_of(&t));
    assert_eq!(hits.len(), 1);
    assert_eq!(idx.medium_name(hits[0].medium), "CPU");
    idx.apply_batch(src(1), &batch(vec![removed(&[1, 2], Medium::Cpu)]));
    assert_eq!(idx.stats().nodes, 0);
    idx.check_invariants().unwrap();
}

#[test]
fn too_few_tokens_is_invalid() {
    let mut idx = Index::new();
    let s = idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2], None, toks(1, 0), Medium::Gpu)]),
    );
    assert_eq!((s.invalid_events, s.blocks_stored), (1, 0));
}

#[test]
fn salt_lora_and_mm_change_the_keys() {
    let mut idx = Index::new();
    let t = toks(1, 0);
    let mut ev = BlockStored {
        block_hashes: vec![1],
        parent_block_hash: None,
        token_ids: t.clone(),
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: Some("l".into()),
        extra_keys: vec![Some(vec![
            ExtraKey::Str("l".into()),
            ExtraKey::Str("salt".into()),
        ])],
        group_idx: 0,
        cache_salt: None,
    };
    idx.apply_batch(src(1), &batch(vec![Event::BlockStored(ev.clone())]));
    let ns = Namespace {
        lora: "l".into(),
        tenant: "salt".into(),
        block_size: BS,
        ..Default::default()
    };
    let mut keys = vec![];
    chain_keys(ns.id(), &t, BS as usize, &mut keys);
    assert_eq!(idx.match_keys(&keys).len(), 1);
    assert!(idx.match_keys(&keys_of(&t)).is_empty());
    ev.extra_keys = vec![Some(vec![ExtraKey::Mm {
        hash: "img".into(),
        offset: 1,
    }])];
    ev.block_hashes = vec![2];
    idx.apply_batch(src(2), &batch(vec![Event::BlockStored(ev)]));
    let ns = Namespace {
        tenant: String::new(),
        ..ns
    };
    let mm = [("img".to_string(), 1i64)];
    let key = crate::content_key::chain_block(ns.id(), &t, Some(&mm));
    assert_eq!(idx.match_keys(&[key])[0].worker, 2);
}

#[test]
fn pins_keep_nodes_and_unpin_collects() {
    let mut idx = Index::new();
    idx.pin(&[5, 6, 7]);
    assert_eq!(idx.stats().blocks, 3);
    let all = idx.scan(&[]);
    assert!(all.iter().all(|e| e.pinned && e.holders.is_empty()));
    assert_eq!(
        idx.scan(&[6]).iter().map(|e| e.key).collect::<Vec<_>>(),
        vec![6, 7]
    );
    idx.unpin(&[5, 6, 7]);
    idx.unpin(&[5, 6, 7]);
    assert_eq!(idx.stats().nodes, 0);
    idx.check_invariants().unwrap();
}

#[test]
fn clear_and_remove_worker() {
    let mut idx = Index::new();
    for w in 0..3 {
        for dp in 0..2 {
            let s = SourceKey {
                worker: w,
                dp_rank: dp,
            };
            idx.apply_batch(
                s,
                &batch(vec![stored(&[1, 2], None, toks(2, w as u32), Medium::Gpu)]),
            );
        }
    }
    assert_eq!(idx.stats().resident_pairs, 12);
    assert_eq!(
        idx.clear_source(SourceKey {
            worker: 0,
            dp_rank: 1
        }),
        2
    );
    assert_eq!(idx.remove_worker(1), 4);
    assert_eq!(idx.stats().sources, 4);
    assert_eq!(idx.stats().resident_pairs, 6);
    idx.apply_batch(src(2), &batch(vec![Event::AllBlocksCleared]));
    assert_eq!(idx.stats().resident_pairs, 4);
    idx.check_invariants().unwrap();
}

#[test]
fn snapshot_roundtrip_and_corruption() {
    let mut idx = Index::new();
    idx.register_source(src(1), "m", "tok");
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2], None, toks(2, 0), Medium::Gpu)]),
    );
    idx.apply_batch(
        src(2),
        &batch(vec![stored(&[1], None, toks(1, 0), Medium::Cpu)]),
    );
    idx.pin(&[42, 43]);
    let mut buf = vec![];
    idx.write_snapshot(&mut buf).unwrap();
    let back = Index::read_snapshot(&mut buf.as_slice()).unwrap();
    assert!(back.state_eq(&idx));
    assert_eq!(back.stats().resident_pairs, idx.stats().resident_pairs);
    for i in [0, 9, buf.len() / 2, buf.len() - 1] {
        let mut bad = buf.clone();
        bad[i] ^= 0x40;
        assert!(
            Index::read_snapshot(&mut bad.as_slice()).is_err(),
            "flip at {i}"
        );
    }
    assert!(Index::read_snapshot(&mut &buf[..buf.len() - 3]).is_err());
}

/// One random operation of a stream over 3 workers × 2 ranks, 2 media, a small
/// token alphabet (so sequences share prefixes) and small hash space (collisions,
/// re-stores, unknown parents).
#[derive(Debug, Clone)]
enum Op {
    Store {
        w: u64,
        dp: u32,
        blocks: u32,
        start: Option<u64>,
        hash0: u64,
        alpha: u32,
        cpu: bool,
        tokenless: bool,
    },
    Remove {
        w: u64,
        dp: u32,
        hash: u64,
        cpu: bool,
    },
    Clear {
        w: u64,
        dp: u32,
    },
    RemoveWorker {
        w: u64,
    },
    Pin {
        alpha: u32,
        blocks: u32,
    },
    Unpin {
        alpha: u32,
        blocks: u32,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3u64, 0..2u32, 1..4u32, proptest::option::of(0..12u64), 0..12u64, 0..3u32, any::<bool>(), proptest::bool::weighted(0.15))
            .prop_map(|(w, dp, blocks, start, hash0, alpha, cpu, tokenless)| Op::Store { w, dp, blocks, start, hash0, alpha, cpu, tokenless }),
        4 => (0..3u64, 0..2u32, 0..14u64, any::<bool>()).prop_map(|(w, dp, hash, cpu)| Op::Remove { w, dp, hash, cpu }),
        1 => (0..3u64, 0..2u32).prop_map(|(w, dp)| Op::Clear { w, dp }),
        1 => (0..3u64).prop_map(|w| Op::RemoveWorker { w }),
        1 => (0..3u32, 1..4u32).prop_map(|(alpha, blocks)| Op::Pin { alpha, blocks }),
        1 => (0..3u32, 1..4u32).prop_map(|(alpha, blocks)| Op::Unpin { alpha, blocks }),
    ]
}

fn medium(cpu: bool) -> Medium {
    if cpu {
        Medium::Cpu
    } else {
        Medium::Gpu
    }
}

fn run(idx: &mut Index, ops: &[Op]) {
    for o in ops {
        match *o {
            Op::Store {
                w,
                dp,
                blocks,
                start,
                hash0,
                alpha,
                cpu,
                tokenless,
            } => {
                let hashes: Vec<u64> = (0..blocks as u64).map(|i| hash0 + i).collect();
                let tokens = if tokenless {
                    vec![]
                } else {
                    toks(blocks, alpha)
                };
                let ev = stored(&hashes, start, tokens, medium(cpu));
                idx.apply_batch(
                    SourceKey {
                        worker: w,
                        dp_rank: dp,
                    },
                    &batch(vec![ev]),
                );
            }
            Op::Remove { w, dp, hash, cpu } => {
                idx.apply_batch(
                    SourceKey {
                        worker: w,
                        dp_rank: dp,
                    },
                    &batch(vec![removed(&[hash], medium(cpu))]),
                );
            }
            Op::Clear { w, dp } => {
                idx.clear_source(SourceKey {
                    worker: w,
                    dp_rank: dp,
                });
            }
            Op::RemoveWorker { w } => {
                idx.remove_worker(w);
            }
            Op::Pin { alpha, blocks } => idx.pin(&keys_of(&toks(blocks, alpha))),
            Op::Unpin { alpha, blocks } => idx.unpin(&keys_of(&toks(blocks, alpha))),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn invariants_hold_and_everything_goes_away(ops in proptest::collection::vec(op(), 1..60)) {
        let mut idx = Index::new();
        run(&mut idx, &ops);
        idx.check_invariants().map_err(TestCaseError::fail)?;
        let mut buf = vec![];
        idx.write_snapshot(&mut buf).unwrap();
        let mut back = Index::read_snapshot(&mut buf.as_slice()).unwrap();
        prop_assert!(back.state_eq(&idx));
        back.check_invariants().map_err(TestCaseError::fail)?;
        for alpha in 0..3 {
            let keys = keys_of(&toks(3, alpha));
            prop_assert_eq!(back.match_keys(&keys), idx.match_keys(&keys));
        }
        for w in 0..3 {
            // The restored index removes through its rebuilt per-source lists.
            prop_assert_eq!(back.remove_worker(w), idx.remove_worker(w));
            prop_assert!(back.state_eq(&idx));
        }
        for alpha in 0..3 {
            for blocks in 1..4 {
                for _ in 0..ops.len() {
                    idx.unpin(&keys_of(&toks(blocks, alpha)));
                }
            }
        }
        let st = idx.stats();
        prop_assert_eq!((st.nodes, st.blocks, st.resident_pairs, st.sources), (0, 0, 0, 0));
        idx.check_invariants().map_err(TestCaseError::fail)?;
    }
}

proptest! {
    /// The ingest's key chain with a reused buffer is `chain_block`, for small blocks
    /// (its stack path) and large ones (vLLM's 512-token blocks).
    #[test]
    fn reused_buffer_keys_equal_chain_block(
        parent in any::<u64>(),
        blocks in proptest::collection::vec(proptest::collection::vec(any::<u32>(), 0..700), 1..4),
    ) {
        let mut buf = vec![];
        for tokens in &blocks {
            prop_assert_eq!(
                super::apply::chain_block_reusing(&mut buf, parent, tokens),
                crate::content_key::chain_block(parent, tokens, None)
            );
        }
    }
}

// --- apply_payloads (batch ingest) against apply_payload one by one -------------

/// One event of a generated payload.
#[derive(Debug, Clone)]
enum WireOp {
    Store {
        blocks: u32,
        start: Option<u64>,
        hash0: u64,
        alpha: u32,
        cpu: bool,
        tokenless: bool,
    },
    Remove {
        hash: u64,
        cpu: bool,
    },
    Clear,
}

fn wire_op() -> impl Strategy<Value = WireOp> {
    prop_oneof![
        6 => (1..5u32, proptest::option::of(0..14u64), 0..14u64, 0..3u32, any::<bool>(), proptest::bool::weighted(0.1))
            .prop_map(|(blocks, start, hash0, alpha, cpu, tokenless)| WireOp::Store { blocks, start, hash0, alpha, cpu, tokenless }),
        3 => (0..16u64, any::<bool>()).prop_map(|(hash, cpu)| WireOp::Remove { hash, cpu }),
        1 => Just(WireOp::Clear),
    ]
}

/// `[ts, [events as maps], dp_rank]`, vLLM's map form (a negative rank is invalid).
fn encode_payload(dp_rank: i64, ops: &[WireOp]) -> Vec<u8> {
    use rmp::encode::*;
    let mut w = vec![];
    write_array_len(&mut w, 3).unwrap();
    write_f64(&mut w, 1.0).unwrap();
    write_array_len(&mut w, ops.len() as u32).unwrap();
    for op in ops {
        match op {
            &WireOp::Store {
                blocks,
                start,
                hash0,
                alpha,
                cpu,
                tokenless,
            } => {
                write_map_len(&mut w, 6).unwrap();
                write_str(&mut w, "type").unwrap();
                write_str(&mut w, "BlockStored").unwrap();
                write_str(&mut w, "block_hashes").unwrap();
                write_array_len(&mut w, blocks).unwrap();
                for i in 0..blocks as u64 {
                    write_uint(&mut w, hash0 + i).unwrap();
                }
                write_str(&mut w, "parent_block_hash").unwrap();
                match start {
                    Some(p) => write_uint(&mut w, p).map(|_| ()).unwrap(),
                    None => write_nil(&mut w).unwrap(),
                }
                let tokens = if tokenless {
                    vec![]
                } else {
                    toks(blocks, alpha)
                };
                write_str(&mut w, "token_ids").unwrap();
                write_array_len(&mut w, tokens.len() as u32).unwrap();
                for t in tokens {
                    write_uint(&mut w, t as u64).unwrap();
                }
                write_str(&mut w, "block_size").unwrap();
                write_uint(&mut w, BS as u64).unwrap();
                write_str(&mut w, "medium").unwrap();
                write_str(&mut w, if cpu { "CPU" } else { "GPU" }).unwrap();
            }
            &WireOp::Remove { hash, cpu } => {
                write_map_len(&mut w, 3).unwrap();
                write_str(&mut w, "type").unwrap();
                write_str(&mut w, "BlockRemoved").unwrap();
                write_str(&mut w, "block_hashes").unwrap();
                write_array_len(&mut w, 1).unwrap();
                write_uint(&mut w, hash).unwrap();
                write_str(&mut w, "medium").unwrap();
                write_str(&mut w, if cpu { "CPU" } else { "GPU" }).unwrap();
            }
            WireOp::Clear => {
                write_map_len(&mut w, 1).unwrap();
                write_str(&mut w, "type").unwrap();
                write_str(&mut w, "AllBlocksCleared").unwrap();
            }
        }
    }
    write_sint(&mut w, dp_rank).unwrap();
    w
}

/// A call: worker, then payloads of (dp rank, events, truncate to make it corrupt).
type Call = (u64, Vec<(i64, Vec<WireOp>, bool)>);

fn call() -> impl Strategy<Value = Call> {
    let payload = (
        // Now and then a rank that is not one: an error after a decoded batch.
        prop_oneof![30 => 0..2i64, 1 => Just(-1i64)],
        proptest::collection::vec(wire_op(), 1..4),
        proptest::bool::weighted(0.03),
    );
    (0..3u64, proptest::collection::vec(payload, 1..8))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// `apply_payloads` (key chains planned ahead across events and windows) leaves
    /// exactly the index, stats and errors of `apply_payload` on each payload.
    #[test]
    fn apply_payloads_equals_one_by_one(calls in proptest::collection::vec(call(), 1..12)) {
        let mut batched = Index::new();
        let mut single = Index::new();
        for (worker, payloads) in &calls {
            let source = src(*worker);
            let bytes: Vec<Vec<u8>> = payloads
                .iter()
                .map(|(dp, ops, corrupt)| {
                    let mut b = encode_payload(*dp, ops);
                    if *corrupt {
                        b.truncate(b.len() / 2);
                    }
                    b
                })
                .collect();
            let mut want = ApplyStats::default();
            let mut want_err = None;
            for (i, p) in bytes.iter().enumerate() {
                match single.apply_payload(source, p) {
                    Ok(s) => want += s,
                    Err(e) => {
                        want_err = Some((i, e));
                        break;
                    }
                }
            }
            match (batched.apply_payloads(source, &bytes), want_err) {
                (Ok(got), None) => prop_assert_eq!(got, want),
                (Err(got), Some((i, e))) => {
                    prop_assert_eq!(got.index, i);
                    prop_assert_eq!(got.error, e);
                    prop_assert_eq!(got.applied, want);
                }
                (got, want_err) => prop_assert!(false, "got {:?}, want error {:?}", got, want_err),
            }
            prop_assert!(batched.state_eq(&single));
        }
        batched.check_invariants().map_err(TestCaseError::fail)?;
        for alpha in 0..3 {
            for n in 1..6 {
                let keys = keys_of(&toks(n, alpha));
                prop_assert_eq!(batched.match_keys(&keys), single.match_keys(&keys));
            }
        }
    }
}

/// Against a reference that resolves every key through the table alone: match
/// tries the slot after the previous block first, and must not be fooled by a
/// freed slot that still holds an old key.
#[test]
fn match_skips_freed_slots_that_kept_their_key() {
    let mut idx = Index::new();
    let t = toks(2, 1);
    let keys = keys_of(&t);
    let bs = BS as usize;
    // Slots 0, 1: blocks 0, 1 (source 1); slot 2: an unrelated block.
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1, 2], None, t.clone(), Medium::Gpu)]),
    );
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[7], None, toks(1, 2), Medium::Gpu)]),
    );
    idx.apply_batch(
        src(2),
        &batch(vec![stored(&[1], None, t[..bs].to_vec(), Medium::Gpu)]),
    );
    // Free slot 1 (block 1, its key left in place), then slot 2; block 1 comes
    // back in slot 2, so slot 1, right after block 0's, holds a stale copy of its key.
    idx.apply_batch(src(1), &batch(vec![removed(&[2], Medium::Gpu)]));
    idx.apply_batch(src(1), &batch(vec![removed(&[7], Medium::Gpu)]));
    idx.apply_batch(
        src(2),
        &batch(vec![stored(&[2], Some(1), t[bs..].to_vec(), Medium::Gpu)]),
    );
    let hits = idx.match_keys(&keys);
    let found: Vec<(u64, u32)> = hits.iter().map(|h| (h.worker, h.blocks)).collect();
    assert_eq!(found, vec![(1, 1), (2, 2)]);
    assert_eq!(hits, idx.match_keys_table_only(&keys));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Match equals a table-only walk on random streams (runs, reused slots, gaps).
    #[test]
    fn match_equals_table_only_walk(ops in proptest::collection::vec(op(), 1..80)) {
        let mut idx = Index::new();
        run(&mut idx, &ops);
        for alpha in 0..3 {
            for n in 1..5 {
                let keys = keys_of(&toks(n, alpha));
                prop_assert_eq!(idx.match_keys(&keys), idx.match_keys_table_only(&keys));
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(100))]

    /// A capacity hint at any point changes capacity only: same state, same matches.
    #[test]
    fn reserve_changes_nothing_but_capacity(
        ops in proptest::collection::vec(op(), 1..60),
        at in 0..60usize,
        blocks in 0..300u64,
    ) {
        let mut plain = Index::new();
        let mut hinted = Index::new();
        let at = at.min(ops.len());
        run(&mut plain, &ops);
        run(&mut hinted, &ops[..at]);
        hinted.reserve(blocks).unwrap();
        run(&mut hinted, &ops[at..]);
        prop_assert!(hinted.state_eq(&plain));
        hinted.check_invariants().map_err(TestCaseError::fail)?;
        for alpha in 0..3 {
            let keys = keys_of(&toks(3, alpha));
            prop_assert_eq!(hinted.match_keys(&keys), plain.match_keys(&keys));
        }
    }
}

#[test]
fn reserve_refuses_absurd_hints_and_counts_what_it_takes() {
    let mut idx = Index::new();
    let before = idx.stats().memory_bytes;
    assert_eq!(
        idx.reserve(MAX_RESERVE_BLOCKS + 1),
        Err(ReserveError::TooLarge {
            blocks: MAX_RESERVE_BLOCKS + 1
        })
    );
    assert_eq!(idx.stats().memory_bytes, before);
    idx.reserve(10_000).unwrap();
    // 10 000 nodes of 40 B, two tables of 16 384 four-byte slots.
    assert!(idx.stats().memory_bytes >= before + 400_000 + 2 * 65_536);
}

/// An offload-tier store of blocks the source already holds (no tokens, so the block
/// itself costs nothing new): only the medium name can grow the index.
fn offload(hash: u64, name: String) -> Event {
    stored(&[hash], None, vec![], Medium::Other(name))
}

#[test]
fn long_medium_names_go_to_other_and_memory_stays_bounded() {
    let mut idx = Index::new();
    let t = toks(1, 0);
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1], None, t.clone(), Medium::Gpu)]),
    );
    let before = idx.stats().memory_bytes;
    for i in 0..300u32 {
        let name = format!("{i:04}{}", "x".repeat(1 << 20)); // 300 distinct 1 MiB names
        let s = idx.apply_batch(src(1), &batch(vec![offload(1, name)]));
        assert_eq!(s.blocks_stored, 1);
    }
    let stats = idx.stats();
    assert_eq!(stats.media_folded, 300);
    let grown = stats.memory_bytes - before;
    assert!(grown < 64 << 10, "the index grew by {grown} bytes");
    let hits = idx.match_keys(&keys_of(&t));
    let media: Vec<&str> = hits.iter().map(|h| idx.medium_name(h.medium)).collect();
    assert_eq!(media, vec!["GPU", OTHER_MEDIUM]);
    // A removal under an over-long name finds the block where its store put it.
    let name = format!("0000{}", "x".repeat(1 << 20));
    let s = idx.apply_batch(src(1), &batch(vec![removed(&[1], Medium::Other(name))]));
    assert_eq!((s.blocks_removed, s.unknown_removals), (1, 0));
    idx.check_invariants().unwrap();
}

#[test]
fn unknown_medium_names_beyond_the_limit_go_to_other_but_known_ones_never_do() {
    let mut idx = Index::new();
    let t = toks(1, 0);
    idx.apply_batch(
        src(1),
        &batch(vec![stored(&[1], None, t.clone(), Medium::Gpu)]),
    );
    for i in 0..300 {
        idx.apply_batch(src(1), &batch(vec![offload(1, format!("tier{i}"))]));
    }
    assert_eq!(idx.stats().media_folded, (300 - MAX_CUSTOM_MEDIA) as u64);
    for &known in KNOWN_MEDIA.iter().chain(&["CPU_PINNED", "STORAGE", "disk"]) {
        let medium = Medium::parse(Some(known)); // as decoded
        let ev = stored(&[1], None, vec![], medium);
        idx.apply_batch(src(1), &batch(vec![ev]));
    }
    assert_eq!(idx.stats().media_folded, (300 - MAX_CUSTOM_MEDIA) as u64);
    let hits = idx.match_keys(&keys_of(&t));
    let mut media: Vec<&str> = hits.iter().map(|h| idx.medium_name(h.medium)).collect();
    media.sort_unstable();
    let mut expected: Vec<String> = (0..MAX_CUSTOM_MEDIA).map(|i| format!("tier{i}")).collect();
    expected.extend(KNOWN_MEDIA.iter().map(|k| k.to_string()));
    expected.extend(["GPU", "CPU", "DISK"].map(String::from));
    expected.sort_unstable();
    assert_eq!(media, expected);
    // A name that was never kept removes from OTHER; a kept one from its own medium.
    let s = idx.apply_batch(
        src(1),
        &batch(vec![removed(&[1], Medium::Other("tier299".into()))]),
    );
    assert_eq!(s.blocks_removed, 1);
    let s = idx.apply_batch(
        src(1),
        &batch(vec![removed(&[1], Medium::Other("tier3".into()))]),
    );
    assert_eq!(s.blocks_removed, 1);
    let hits = idx.match_keys(&keys_of(&t));
    // tier3's holder is gone; OTHER's stays (each folded store counted one copy).
    assert_eq!(hits.len(), expected.len() - 1);
    assert!(hits.iter().all(|h| idx.medium_name(h.medium) != "tier3"));
    idx.check_invariants().unwrap();
}

/// `match_compact` against `match_keys`: it expands to exactly the full match, and
/// is the canonical form, each floor being the least match of its medium over the
/// live sources and the hits exactly the pairs above their medium's floor.
fn check_compact(idx: &Index, keys: &[u64]) -> Result<(), TestCaseError> {
    let full = idx.match_keys(keys);
    let compact = idx.match_compact(keys);
    prop_assert_eq!(&idx.expand_match(&compact), &full);
    let live = idx.sources.ordered();
    let mut floors = vec![];
    for m in 0..idx.media.len() as u8 {
        let least = live
            .iter()
            .map(|(k, _)| {
                full.iter()
                    .find(|h| h.worker == k.worker && h.dp_rank == k.dp_rank && h.medium == m)
                    .map_or(0, |h| h.blocks)
            })
            .min()
            .unwrap_or(0);
        if least > 0 {
            floors.push((m, least));
        }
    }
    floors.sort_by_key(|&(m, _)| idx.media.rank(m));
    prop_assert_eq!(&compact.floors, &floors);
    let hits: Vec<MatchHit> = full
        .iter()
        .filter(|h| h.blocks > compact.floor(h.medium))
        .copied()
        .collect();
    prop_assert_eq!(&compact.hits, &hits);
    Ok(())
}

/// Streams where the few sources mostly store the same prompts from block 0 (so
/// that floors exist, end at different depths per medium, and vanish when a source
/// clears or evicts).
fn shared_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (0..3u64, 1..6u32, proptest::option::of(0..12u64), 0..2u32, any::<bool>())
            .prop_map(|(w, blocks, start, alpha, cpu)| Op::Store {
                w,
                dp: 0,
                blocks,
                start: start.filter(|s| s % 3 == 0),
                hash0: 0,
                alpha,
                cpu,
                tokenless: false,
            }),
        3 => (0..3u64, 0..6u64, any::<bool>()).prop_map(|(w, hash, cpu)| Op::Remove { w, dp: 0, hash, cpu }),
        1 => (0..3u64).prop_map(|w| Op::Clear { w, dp: 0 }),
        1 => (0..3u64).prop_map(|w| Op::RemoveWorker { w }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn compact_match_expands_to_the_full_match(
        ops in proptest::collection::vec(op(), 1..80),
        shared in proptest::collection::vec(shared_op(), 1..60),
    ) {
        for ops in [&ops, &shared] {
            let mut idx = Index::new();
            run(&mut idx, ops);
            for alpha in 0..3 {
                for n in 1..7 {
                    let mut keys = keys_of(&toks(n, alpha));
                    check_compact(&idx, &keys)?;
                    keys.push(0xdead_beef);
                    check_compact(&idx, &keys)?;
                }
            }
            check_compact(&idx, &[])?;
        }
    }
}

/// A fleet's shape: every source holds a prompt in GPU, some also in CPU, two go
/// deeper. The floor stands for all of them; only the deeper ones are listed. One
/// source that lacks the prompt takes the floor away.
#[test]
fn a_prompt_every_source_holds_is_one_floor() {
    let mut idx = Index::new();
    let t = toks(6, 0);
    let keys = keys_of(&t);
    let bs = BS as usize;
    for w in 0..40 {
        let ev = stored(&[1, 2, 3], None, t[..3 * bs].to_vec(), Medium::Gpu);
        idx.apply_batch(src(w), &batch(vec![ev]));
    }
    for w in [3, 7] {
        let ev = stored(&[4, 5], Some(3), t[3 * bs..5 * bs].to_vec(), Medium::Gpu);
        idx.apply_batch(src(w), &batch(vec![ev]));
    }
    for w in 0..40 {
        let ev = stored(&[1], None, t[..bs].to_vec(), Medium::Cpu);
        idx.apply_batch(src(w), &batch(vec![ev]));
    }
    let c = idx.match_compact(&keys);
    let (gpu, cpu) = (
        idx.media.find(&Medium::Gpu).unwrap(),
        idx.media.find(&Medium::Cpu).unwrap(),
    );
    assert_eq!(c.floors, vec![(cpu, 1), (gpu, 3)]);
    let deeper: Vec<(u64, u32)> = c.hits.iter().map(|h| (h.worker, h.blocks)).collect();
    assert_eq!(deeper, vec![(3, 5), (7, 5)]);
    assert_eq!(idx.expand_match(&c), idx.match_keys(&keys));
    assert_eq!(idx.expand_match(&c).len(), 80);
    idx.register_source(src(99), "", "");
    let c = idx.match_compact(&keys);
    assert!(c.floors.is_empty());
    assert_eq!(c.hits, idx.match_keys(&keys));
}
