//! Applying decoded event batches: BlockStored, BlockRemoved, AllBlocksCleared.

use crate::content_key::{chain_block, SEED};
use crate::events::{
    decode_batch, DecodeError, Event, EventBatch, EventRef, RemovedRef, StoredRef,
};
use crate::namespace::Namespace;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::batch::Plan;
use super::holders::{self, holder_id, HolderId, Removed};
use super::sources::engine_map_key;
use super::tree::NIL;
use super::{ApplyStats, Index, SourceKey};

impl Index {
    /// Decodes one raw msgpack batch and applies it. The batch's own dp rank wins;
    /// `source.dp_rank` is used when the batch carries none (very old vLLM).
    pub fn apply_payload(
        &mut self,
        source: SourceKey,
        payload: &[u8],
    ) -> Result<ApplyStats, DecodeError> {
        let batch = decode_batch(payload)?;
        let source = resolve_rank(source, &batch)?;
        Ok(self.apply_batch(source, &batch))
    }

    /// Applies one decoded batch for `source` (its dp rank taken as given).
    pub fn apply_batch(&mut self, source: SourceKey, batch: &EventBatch) -> ApplyStats {
        let events = batch.events.iter().map(Event::as_ref);
        self.apply_events_planned(source, batch.events.len(), events, &mut Plan::none())
    }

    /// Applies the `count` events of one batch for `source`, taking each
    /// BlockStored's key chain from `plan` when it was computed from the parent key
    /// the event turns out to have.
    pub(super) fn apply_events_planned<'e>(
        &mut self,
        source: SourceKey,
        count: usize,
        events: impl Iterator<Item = EventRef<'e>>,
        plan: &mut Plan,
    ) -> ApplyStats {
        let mut stats = ApplyStats {
            batches: 1,
            events: count as u64,
            ..Default::default()
        };
        let Some(slot) = self.sources.slot_or_create(source, holders::MAX_SLOT) else {
            // More than 16 M live sources: refuse rather than corrupt holder ids.
            stats.invalid_events = stats.events;
            plan.skip(count);
            return stats;
        };
        for event in events {
            let chain = plan.next_event();
            if let Some(c) = chain {
                plan.prefetch_through(&self.tree, c.end);
            }
            match event {
                EventRef::BlockStored(ev) => {
                    let planned = chain.map(|c| (c.parent, &plan.keys[c.start..c.end]));
                    self.store(slot, &ev, &mut stats, planned)
                }
                EventRef::BlockRemoved(ev) => self.remove(slot, &ev, &mut stats),
                EventRef::AllBlocksCleared => {
                    stats.clears += 1;
                    self.clear_slot(slot);
                }
            }
        }
        stats
    }

    /// One more reference of (source, medium) on a node; keeps the counters exact.
    fn add_holder(&mut self, slot: u32, id: u32, hid: HolderId) {
        let was_visible = self.visible(id);
        let mut set = self.tree.holders(id);
        let new_pair = set.add(&mut self.tree.spills, hid, 1);
        self.tree.set_holders(id, set);
        if new_pair {
            self.resident_pairs += 1;
            self.sources.get_mut(slot).pairs += 1;
            if set.slot_count(&self.tree.spills, slot) == 1 {
                self.note_held(slot, id);
            }
        }
        if !was_visible {
            self.blocks += 1;
        }
    }

    /// After holders/pins of `id` shrank: fix `blocks` and collect what is now empty.
    pub(super) fn after_shrink(&mut self, id: u32, was_visible: bool) {
        if was_visible && !self.visible(id) {
            self.blocks -= 1;
        }
        self.tree.collect(id);
    }

    /// `planned`: `(parent key, keys)` computed ahead (batch ingest), used if the
    /// parent key is that one (the keys are a function of it and the event).
    fn store(
        &mut self,
        slot: u32,
        ev: &StoredRef<'_>,
        stats: &mut ApplyStats,
        planned: Option<(u64, &[u64])>,
    ) {
        let n = ev.block_hashes.len();
        if n == 0 {
            return;
        }
        let Some((medium, folded)) = self.media.intern(ev.medium) else {
            stats.invalid_events += 1;
            return;
        };
        self.media_folded += u64::from(folded);
        let hid = holder_id(slot, medium);
        let group = ev.group_idx;
        if ev.token_ids.is_empty() {
            // An offload tier storing blocks it got from another medium: the source
            // already knows these hashes (with their keys) from that medium.
            for &h in ev.block_hashes {
                let known = self.resolve(slot, engine_map_key(group, h));
                match known.and_then(|key| self.tree.find(key)) {
                    Some(id) => {
                        self.add_holder(slot, id, hid);
                        stats.blocks_stored += 1;
                    }
                    None => stats.orphan_blocks += 1,
                }
            }
            return;
        }
        let bs = ev.block_size as usize;
        let needed = (n as u64).saturating_mul(bs as u64);
        if bs == 0 || (ev.token_ids.len() as u64) < needed {
            stats.invalid_events += 1;
            return;
        }
        let (mut parent_key, mut parent_id, mut depth) = match ev.parent_block_hash {
            None => (self.namespace_of(slot, ev).id(), NIL, 0u32),
            Some(ph) => {
                let known = self.resolve(slot, engine_map_key(group, ph));
                match known.and_then(|key| self.tree.find(key)) {
                    Some(pid) => {
                        let depth = self.tree.node(pid).depth();
                        (self.tree.key(pid), pid, depth.saturating_add(1))
                    }
                    None => {
                        // Its prefix is unknown, so it could never be matched.
                        stats.orphan_blocks += n as u64;
                        return;
                    }
                }
            }
        };
        // Pass 1: the chain of keys, then prefetches and probes of every key's table
        // slot and every hash's ehash slot. The probes are independent, so their
        // cache misses overlap; pass 2 then finds those lines in cache. A planned
        // chain was prefetched further ahead already (`Plan::prefetch_through`).
        let mut own = Vec::new();
        let keys: &[u64] = match planned {
            Some((p, keys)) if p == parent_key && keys.len() == n => keys,
            _ => {
                chain_keys(ev, parent_key, &mut own);
                self.tree.prefetch_slots(&own);
                self.tree
                    .prefetch_ehash(ev.block_hashes.iter().map(|&h| engine_map_key(group, h)));
                let mut warm = 0u64;
                for &key in &own {
                    warm ^= self.tree.find(key).unwrap_or(0) as u64;
                }
                std::hint::black_box(warm);
                &own
            }
        };
        // Pass 2: insert.
        for (&h, &key) in ev.block_hashes.iter().zip(keys) {
            let id = self.tree.get_or_insert(key, parent_key, parent_id, depth);
            self.add_holder(slot, id, hid);
            self.set_mapping(slot, engine_map_key(group, h), id);
            stats.blocks_stored += 1;
            parent_key = key;
            parent_id = id;
            depth = depth.saturating_add(1);
        }
    }

    /// The namespace of a BlockStored that starts at block 0 (`docs/index.md`).
    pub(super) fn namespace_of(&self, slot: u32, ev: &StoredRef<'_>) -> Namespace {
        let src = self.sources.get(slot);
        ev.identity()
            .namespace(src.model.clone(), src.tokenizer.clone(), ev.block_size)
    }

    fn remove(&mut self, slot: u32, ev: &RemovedRef<'_>, stats: &mut ApplyStats) {
        let medium = self.media.resolve(ev.medium);
        for &h in ev.block_hashes {
            let map_key = engine_map_key(ev.group_idx, h);
            let Some(key) = self.resolve(slot, map_key) else {
                stats.unknown_removals += 1;
                continue;
            };
            let Some(id) = self.tree.find(key) else {
                // Stale mapping (another hash of the same content went first).
                stats.unknown_removals += 1;
                self.delete_mapping(slot, map_key);
                continue;
            };
            let was_visible = self.visible(id);
            let claimed = self.tree.holders(id).claimed_by(&self.tree.spills, slot);
            let outcome = match medium {
                Some(m) => {
                    let mut set = self.tree.holders(id);
                    let r = set.remove_one(&mut self.tree.spills, holder_id(slot, m));
                    self.tree.set_holders(id, set);
                    r
                }
                None => Removed::NotHeld,
            };
            match outcome {
                Removed::NotHeld => stats.unknown_removals += 1,
                Removed::Decremented => stats.blocks_removed += 1,
                Removed::Gone => {
                    stats.blocks_removed += 1;
                    self.resident_pairs -= 1;
                    self.sources.get_mut(slot).pairs -= 1;
                }
            }
            if !self.tree.holders(id).has_slot(&self.tree.spills, slot) {
                // The source's claim on the primary hash went with its last holder;
                // unless that is the hash being removed, the mapping stays, explicitly.
                let ehash = self.tree.node(id).ehash();
                if let Some(primary) = ehash.filter(|&e| claimed && e != map_key) {
                    self.sources.get_mut(slot).engine.insert(primary, key);
                }
                self.delete_mapping(slot, map_key);
            }
            self.after_shrink(id, was_visible);
        }
        self.after_letting_go(slot);
    }

    /// The content key that `(group, hash)` (as `engine_map_key`) names in the engine
    /// map of source `slot`: its explicit entry, else the primary hash of a block the
    /// source claims.
    #[inline]
    pub(super) fn resolve(&self, slot: u32, map_key: u64) -> Option<u64> {
        if let Some(&key) = self.sources.get(slot).engine.get(&map_key) {
            return Some(key);
        }
        let id = self.tree.find_ehash(map_key)?;
        self.tree
            .holders(id)
            .claimed_by(&self.tree.spills, slot)
            .then(|| self.tree.key(id))
    }

    /// Maps `map_key` to node `id` (which the source holds) in the source's engine map:
    /// as a claim when it is (or can become) the block's primary hash, else explicitly.
    fn set_mapping(&mut self, slot: u32, map_key: u64, id: u32) {
        let primary =
            self.tree.try_set_ehash(id, map_key) || self.tree.node(id).ehash() == Some(map_key);
        if primary {
            self.set_claim(id, slot, true);
            let explicit = &mut self.sources.get_mut(slot).engine;
            if !explicit.is_empty() {
                explicit.remove(&map_key);
            }
        } else {
            // An explicit entry overrides a claim on another block with that hash.
            if let Some(other) = self.tree.find_ehash(map_key) {
                self.set_claim(other, slot, false);
            }
            let key = self.tree.key(id);
            self.sources.get_mut(slot).engine.insert(map_key, key);
        }
    }

    /// Removes `map_key` from the source's engine map (explicit entry or claim).
    fn delete_mapping(&mut self, slot: u32, map_key: u64) {
        if self.sources.get_mut(slot).engine.remove(&map_key).is_none() {
            if let Some(id) = self.tree.find_ehash(map_key) {
                self.set_claim(id, slot, false);
            }
        }
    }

    fn set_claim(&mut self, id: u32, slot: u32, claim: bool) {
        let mut set = self.tree.holders(id);
        set.set_claim(&mut self.tree.spills, slot, claim);
        self.tree.set_holders(id, set);
    }
}

pub(super) fn resolve_rank(
    source: SourceKey,
    batch: &EventBatch,
) -> Result<SourceKey, DecodeError> {
    rank_of(source, batch.dp_rank)
}

/// `source` with the batch's own dp rank, if it carries one.
pub(super) fn rank_of(source: SourceKey, dp_rank: Option<i64>) -> Result<SourceKey, DecodeError> {
    match dp_rank {
        None => Ok(source),
        Some(r) => match u32::try_from(r) {
            Ok(dp_rank) => Ok(SourceKey { dp_rank, ..source }),
            Err(_) => Err(DecodeError {
                message: format!("batch dp_rank {r} is not a valid rank (0 ..= 4294967295)"),
                offset: 0,
            }),
        },
    }
}

/// Appends the content keys of `ev`'s blocks, chained from `parent_key`, to `out`.
/// The event must carry at least `n_hashes × block_size` tokens (`block_size` > 0).
pub(super) fn chain_keys(ev: &StoredRef<'_>, parent_key: u64, out: &mut Vec<u64>) {
    let bs = ev.block_size as usize;
    let n = ev.block_hashes.len();
    out.reserve(n);
    let mut k = parent_key;
    let identity = ev.identity();
    IMAGE.with(|image| {
        let mut fresh = Vec::new();
        let mut kept = image.try_borrow_mut();
        let buf = kept.as_deref_mut().unwrap_or(&mut fresh);
        for (i, tokens) in ev.token_ids.chunks_exact(bs).take(n).enumerate() {
            k = match identity.mm_items(i) {
                Some(mm) => chain_block(k, tokens, Some(&mm)),
                None => chain_block_reusing(buf, k, tokens),
            };
            out.push(k);
        }
    })
}

thread_local! {
    /// The byte image of a block being hashed (`chain_block_reusing`), kept.
    static IMAGE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Whether `store` will chain keys for `ev` (it has tokens, enough of them, a
/// block size): the events a batch plan computes keys for.
pub(super) fn has_key_chain(ev: &StoredRef<'_>) -> bool {
    let n = ev.block_hashes.len() as u64;
    n > 0
        && ev.block_size > 0
        && !ev.token_ids.is_empty()
        && ev.token_ids.len() as u64 >= n.saturating_mul(ev.block_size as u64)
}

/// `chain_block(parent, tokens, None)` with the byte image built in a buffer reused
/// across the blocks of an event: large blocks (vLLM's 512-token blocks in the
/// simulator's traces) otherwise cost an allocation and a per-token append each,
/// and small ones the zeroing of `chain_block`'s whole 520-byte stack buffer. Every
/// byte of `buf[..len]` is overwritten, so it is zeroed only when it grows.
pub(super) fn chain_block_reusing(buf: &mut Vec<u8>, parent: u64, tokens: &[u32]) -> u64 {
    let len = 8 + 4 * tokens.len();
    if buf.len() < len {
        buf.resize(len, 0);
    }
    let image = &mut buf[..len];
    image[..8].copy_from_slice(&parent.to_le_bytes());
    for (dst, t) in image[8..].chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(image, SEED)
}
