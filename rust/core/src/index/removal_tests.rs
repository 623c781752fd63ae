//! Removing a source visits what it held, not the slab (docs/index.md, "Removing a
//! source"): the per-source node lists (`Source::blocks`) must name every node the
//! source holds (after ingest, offloads, evictions and a snapshot restore), stay
//! bounded by its pairs, and a removal must leave nothing of the source behind.

use crate::content_key::chain_keys;
use crate::events::{BlockRemoved, Event, EventBatch, Medium};
use crate::namespace::Namespace;

use super::*;

use super::tests::{self, BS};

fn src(worker: u64) -> SourceKey {
    SourceKey { worker, dp_rank: 0 }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, medium: Medium) -> EventBatch {
    tests::batch(vec![tests::stored(hashes, parent, tokens, medium)])
}

fn removed(hashes: &[u64]) -> EventBatch {
    batch(Event::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium: Medium::Gpu,
        group_idx: 0,
    }))
}

fn batch(event: Event) -> EventBatch {
    tests::batch(vec![event])
}

/// Tokens of blocks `from..to` of sequence `seq` (sequence 0: a shared prompt).
fn toks(seq: u32, from: u32, to: u32) -> Vec<u32> {
    (from * BS..to * BS).map(|t| seq * 1_000_000 + t).collect()
}

fn hashes(seq: u32, from: u32, to: u32) -> Vec<u64> {
    (from..to).map(|b| (seq as u64) << 32 | b as u64).collect()
}

fn keys(seq_tokens: &[u32]) -> Vec<u64> {
    let ns = Namespace {
        block_size: BS,
        ..Default::default()
    };
    let mut out = vec![];
    chain_keys(ns.id(), seq_tokens, BS as usize, &mut out);
    out
}

/// Source `w` stores the shared prompt (4 blocks of sequence 0) and then
/// `blocks` blocks of its own sequence `seq` after it.
fn store_session(idx: &mut Index, w: u64, seq: u32, blocks: u32) {
    let s = idx.apply_batch(
        src(w),
        &stored(&hashes(0, 0, 4), None, toks(0, 0, 4), Medium::Gpu),
    );
    assert_eq!(s.orphan_blocks, 0);
    let parent = Some(hashes(0, 3, 4)[0]);
    let tokens: Vec<u32> = (0..blocks * BS).map(|t| seq * 1_000_000 + t).collect();
    let s = idx.apply_batch(
        src(w),
        &stored(&hashes(seq, 0, blocks), parent, tokens, Medium::Gpu),
    );
    assert_eq!(s.orphan_blocks, 0);
}

fn holds_nothing_of(idx: &Index, worker: u64) {
    assert!(idx
        .entries()
        .all(|e| e.holders.iter().all(|h| h.worker != worker)));
    assert!(idx
        .scan(&[])
        .iter()
        .all(|e| e.holders.iter().all(|h| h.worker != worker)));
    assert!(idx
        .logical_state()
        .sources
        .keys()
        .all(|k| k.worker != worker));
}

#[test]
fn a_removal_visits_what_the_source_held_not_the_slab() {
    let mut idx = Index::new();
    // A large engine (20,000 blocks) and a small one (the prompt + 8 blocks).
    store_session(&mut idx, 1, 1, 20_000);
    store_session(&mut idx, 2, 2, 8);
    // The small one offloads its own blocks to CPU (a second medium, same nodes).
    idx.apply_batch(src(2), &stored(&hashes(2, 0, 8), None, vec![], Medium::Cpu));
    idx.check_invariants().unwrap();
    let before = idx.stats();
    assert_eq!(before.resident_pairs, 20_004 + 12 + 8);
    let visits = idx.clear_visits;
    assert_eq!(idx.remove_worker(2), 20);
    // 12 nodes held: a pass over the slab would visit 20,016.
    assert_eq!(idx.clear_visits - visits, 12);
    idx.check_invariants().unwrap();
    let st = idx.stats();
    assert_eq!(
        (st.resident_pairs, st.blocks, st.nodes, st.sources),
        (20_004, 20_004, 20_004, 1)
    );
    holds_nothing_of(&idx, 2);
    let mut prompt_then_own = toks(0, 0, 4);
    prompt_then_own.extend((0..8 * BS).map(|t| 2_000_000 + t));
    let hits = idx.match_keys(&keys(&prompt_then_own));
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].worker, hits[0].blocks), (1, 4));
}

#[test]
fn a_worker_added_again_starts_empty() {
    let mut idx = Index::new();
    store_session(&mut idx, 1, 1, 6);
    store_session(&mut idx, 2, 2, 6);
    idx.remove_worker(1);
    // The same id again: it holds only what it stores now.
    let s = idx.apply_batch(
        src(1),
        &stored(&hashes(0, 0, 2), None, toks(0, 0, 2), Medium::Gpu),
    );
    assert_eq!(s.blocks_stored, 2);
    let mut own = toks(0, 0, 4);
    own.extend((0..6 * BS).map(|t| 1_000_000 + t));
    let hits: Vec<(u64, u32)> = idx
        .match_keys(&keys(&own))
        .iter()
        .map(|h| (h.worker, h.blocks))
        .collect();
    assert_eq!(hits, vec![(1, 2), (2, 4)]);
    // Its old parent hash is unknown to it now: an orphan.
    let s = idx.apply_batch(
        src(1),
        &stored(
            &hashes(1, 6, 7),
            Some(hashes(1, 5, 6)[0]),
            toks(1, 6, 7),
            Medium::Gpu,
        ),
    );
    assert_eq!(s.orphan_blocks, 1);
    idx.check_invariants().unwrap();
    assert_eq!(idx.remove_worker(1), 2);
    assert_eq!(idx.clear_visits, 10 + 2);
    idx.check_invariants().unwrap();
}

#[test]
fn the_lists_stay_bounded_while_an_engine_stores_and_evicts() {
    let mut idx = Index::new();
    store_session(&mut idx, 1, 1, 8);
    store_session(&mut idx, 2, 2, 8);
    // Engine 1 keeps 12 blocks and cycles 40 more in and out, 300 times: 12,000
    // stores. Its list must not keep every node it ever held.
    for round in 0..300u32 {
        let seq = 10 + round;
        let parent = Some(hashes(1, 7, 8)[0]);
        let tokens: Vec<u32> = (0..40 * BS).map(|t| seq * 1_000_000 + t).collect();
        let h = hashes(seq, 0, 40);
        idx.apply_batch(src(1), &stored(&h, parent, tokens, Medium::Gpu));
        if round % 50 == 0 {
            idx.check_invariants().unwrap();
        }
        let s = idx.apply_batch(src(1), &removed(&h));
        assert_eq!(s.blocks_removed, 40);
    }
    idx.check_invariants().unwrap();
    let slot = idx.sources.slot(src(1)).unwrap();
    let list = &idx.sources.get(slot).blocks;
    assert!(
        list.len() <= 4 * 12 + 64 && list.capacity() <= 256,
        "list of {} (capacity {}) for 12 pairs",
        list.len(),
        list.capacity()
    );
    let visits = idx.clear_visits;
    assert_eq!(idx.remove_worker(1), 12);
    assert!(idx.clear_visits - visits <= 4 * 12 + 64);
    holds_nothing_of(&idx, 1);
    idx.check_invariants().unwrap();
    assert_eq!(idx.stats().resident_pairs, 12);
}

#[test]
fn a_restored_index_removes_its_sources_completely() {
    let mut idx = Index::new();
    for w in 1..=6 {
        store_session(&mut idx, w, w as u32, 5 + w as u32);
        if w % 2 == 0 {
            idx.apply_batch(
                src(w),
                &stored(&hashes(w as u32, 0, 3), None, vec![], Medium::Cpu),
            );
        }
    }
    idx.pin(&keys(&toks(0, 0, 2)));
    let mut buf = vec![];
    idx.write_snapshot(&mut buf).unwrap();
    let mut back = Index::read_snapshot(&mut buf.as_slice()).unwrap();
    back.check_invariants().unwrap();
    for w in 1..=6 {
        // The lists are rebuilt from the holders: a removal needs no pass.
        let before = back.clear_visits;
        assert_eq!(back.remove_worker(w), idx.remove_worker(w));
        assert!(back.clear_visits - before <= 4 + 5 + w);
        holds_nothing_of(&back, w);
        back.check_invariants().unwrap();
        assert!(back.state_eq(&idx));
        // A snapshot taken after the removal does not bring the source back.
        let mut again = vec![];
        back.write_snapshot(&mut again).unwrap();
        let reread = Index::read_snapshot(&mut again.as_slice()).unwrap();
        holds_nothing_of(&reread, w);
        assert!(reread.state_eq(&back));
    }
    let st = back.stats();
    assert_eq!(
        (st.resident_pairs, st.sources, st.blocks, st.nodes),
        (0, 0, 2, 2)
    );
}

#[test]
fn clear_source_keeps_the_registration_and_empties_the_list() {
    let mut idx = Index::new();
    idx.register_source(src(3), "m", "t");
    store_session(&mut idx, 3, 3, 10);
    store_session(&mut idx, 4, 4, 10);
    assert_eq!(idx.clear_source(src(3)), 14);
    let slot = idx.sources.slot(src(3)).unwrap();
    assert_eq!(idx.sources.get(slot).blocks.capacity(), 0);
    assert_eq!(idx.sources.get(slot).model, "m");
    holds_nothing_of_residency(&idx, 3);
    // AllBlocksCleared from the engine: the same, and the list refills from empty.
    store_session(&mut idx, 3, 5, 3);
    idx.apply_batch(src(3), &batch(Event::AllBlocksCleared));
    holds_nothing_of_residency(&idx, 3);
    assert_eq!(idx.clear_visits, 14 + 7);
    idx.check_invariants().unwrap();
}

fn holds_nothing_of_residency(idx: &Index, worker: u64) {
    assert!(idx
        .entries()
        .all(|e| e.holders.iter().all(|h| h.worker != worker)));
    assert!(idx
        .match_keys(&keys(&toks(0, 0, 4)))
        .iter()
        .all(|h| h.worker != worker));
}

#[test]
fn an_engine_that_evicts_most_of_what_it_held_gives_the_list_back() {
    let mut idx = Index::new();
    store_session(&mut idx, 1, 1, 4_000);
    store_session(&mut idx, 2, 2, 8);
    // Engine 1 evicts all but its first 8 blocks (and the prompt), newest first,
    // and stores nothing after: no append will compact its list.
    for b in (8..4_000u32)
        .rev()
        .step_by(100)
        .map(|b| b.saturating_sub(99).max(8)..b + 1)
    {
        let s = idx.apply_batch(src(1), &removed(&hashes(1, b.start, b.end)));
        assert_eq!(s.unknown_removals, 0);
    }
    idx.check_invariants().unwrap();
    let slot = idx.sources.slot(src(1)).unwrap();
    let list = &idx.sources.get(slot).blocks;
    assert_eq!(idx.sources.get(slot).pairs, 12);
    assert!(
        list.len() <= 4 * 12 + 64 && list.capacity() <= 2 * list.len() + 64,
        "list of {} (capacity {}) for 12 pairs",
        list.len(),
        list.capacity()
    );
    let visits = idx.clear_visits;
    assert_eq!(idx.remove_worker(1), 12);
    assert!(idx.clear_visits - visits <= 4 * 12 + 64);
    holds_nothing_of(&idx, 1);
    idx.check_invariants().unwrap();
}

fn removed_in(hashes: &[u64], medium: Medium) -> EventBatch {
    batch(Event::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: 0,
    }))
}

/// Source 1 holds the prompt on GPU and offloaded to CPU, and three more blocks on CPU
/// only, stored twice (two references); source 2 holds the prompt on CPU.
fn offloaded() -> Index {
    let mut idx = Index::new();
    let tail_parent = Some(hashes(0, 3, 4)[0]);
    idx.apply_batch(
        src(1),
        &stored(&hashes(0, 0, 4), None, toks(0, 0, 4), Medium::Gpu),
    );
    idx.apply_batch(
        src(1),
        &stored(&hashes(0, 0, 4), None, toks(0, 0, 4), Medium::Cpu),
    );
    for _ in 0..2 {
        idx.apply_batch(
            src(1),
            &stored(&hashes(0, 4, 7), tail_parent, toks(0, 4, 7), Medium::Cpu),
        );
    }
    idx.apply_batch(
        src(2),
        &stored(&hashes(0, 0, 4), None, toks(0, 0, 4), Medium::Cpu),
    );
    idx
}

#[test]
fn clearing_a_medium_is_removing_every_block_the_source_holds_there() {
    let mut cleared = offloaded();
    assert_eq!(cleared.clear_medium(src(1), &Medium::Cpu), 7);
    cleared.check_invariants().unwrap();
    let mut reference = offloaded();
    for hs in [hashes(0, 0, 4), hashes(0, 4, 7), hashes(0, 4, 7)] {
        reference.apply_batch(src(1), &removed_in(&hs, Medium::Cpu));
    }
    assert!(cleared.state_eq(&reference));
    // the GPU copy and the other source's CPU copy stay
    let held: Vec<(u64, String, u32)> = cleared
        .match_keys(&keys(&toks(0, 0, 7)))
        .into_iter()
        .map(|h| {
            (
                h.worker,
                cleared.medium_name(h.medium).to_string(),
                h.blocks,
            )
        })
        .collect();
    assert_eq!(held, vec![(1, "GPU".into(), 4), (2, "CPU".into(), 4)]);
    // nothing there, or an unknown source: nothing dropped
    assert_eq!(cleared.clear_medium(src(1), &Medium::Cpu), 0);
    assert_eq!(cleared.clear_medium(src(9), &Medium::Cpu), 0);
    assert_eq!(cleared.clear_medium(src(1), &Medium::Disk), 0);
    assert!(cleared.state_eq(&reference));
}
