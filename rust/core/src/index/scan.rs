//! Subtree scans, entries, pins, and dropping whole sources.

use std::collections::{BTreeMap, BTreeSet};

use super::holders::{claimed, holder_id, id_of, medium_of, refcount_of, slot_of};
use super::tree::NIL;
use super::{Index, SourceKey};
use crate::events::Medium;

/// One (source, medium) holding a block, with its refcount.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct HolderOut {
    pub worker: u64,
    pub dp_rank: u32,
    pub medium: String,
    pub refcount: u32,
}

/// One block with its holders (sorted by worker, dp rank, medium).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryOut {
    pub key: u64,
    pub parent: u64,
    pub depth: u32,
    pub holders: Vec<HolderOut>,
    pub pinned: bool,
}

/// The complete logical state, independent of slots and memory layout: two indexes
/// are equivalent iff their `LogicalState`s are equal.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LogicalState {
    /// Every node (holder-less interior ones too): key → (parent, depth, pins, holders).
    pub nodes: BTreeMap<u64, (u64, u32, u32, Vec<HolderOut>)>,
    /// source → (model, tokenizer, engine map keyed by `engine_map_key(group, hash)`).
    pub sources: BTreeMap<SourceKey, (String, String, BTreeMap<u64, u64>)>,
}

impl Index {
    fn entry(&self, id: u32) -> EntryOut {
        let n = self.tree.node(id);
        let mut holders: Vec<HolderOut> = self
            .tree
            .holders(id)
            .as_slice(&self.tree.spills)
            .iter()
            .map(|&h| {
                let hid = id_of(h);
                let src = self.sources.get(slot_of(hid)).key;
                HolderOut {
                    worker: src.worker,
                    dp_rank: src.dp_rank,
                    medium: self.media.name(medium_of(hid)).to_string(),
                    refcount: refcount_of(h),
                }
            })
            .collect();
        holders.sort();
        EntryOut {
            key: self.tree.key(id),
            parent: self.tree.parent_key(id),
            depth: n.depth(),
            holders,
            pinned: n.pins > 0,
        }
    }

    /// Every block under the block named by `prefix.last()` (itself included) with a
    /// holder or a pin, sorted by key; every such block for an empty prefix.
    pub fn scan(&self, prefix: &[u64]) -> Vec<EntryOut> {
        let ids: Vec<u32> = match prefix.last() {
            None => self.tree.ids().collect(),
            Some(&k) => match self.tree.find(k) {
                Some(root) => self.tree.subtree(root),
                None => vec![],
            },
        };
        let mut out: Vec<EntryOut> = ids
            .into_iter()
            .filter(|&id| self.visible(id))
            .map(|id| self.entry(id))
            .collect();
        out.sort_unstable_by_key(|e| e.key);
        out
    }

    /// Every block with a holder or a pin, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = EntryOut> + '_ {
        self.tree
            .ids()
            .filter(|&id| self.visible(id))
            .map(|id| self.entry(id))
    }

    /// Pins every block of the path, creating unknown ones (parent = previous key,
    /// 0 for the first; depth = position).
    pub fn pin(&mut self, keys: &[u64]) {
        let mut parent_key = 0;
        let mut parent_id = NIL;
        for (pos, &key) in keys.iter().enumerate() {
            let id = self
                .tree
                .get_or_insert(key, parent_key, parent_id, pos as u32);
            if !self.visible(id) {
                self.blocks += 1;
            }
            let node = self.tree.node_mut(id);
            if node.pins == 0 {
                self.pinned += 1;
            }
            node.pins = node.pins.saturating_add(1);
            parent_key = key;
            parent_id = id;
        }
    }

    /// Undoes one pin of each block of the path (a no-op for unpinned blocks).
    pub fn unpin(&mut self, keys: &[u64]) {
        // Deepest first, so a collected child frees its parent in the same pass.
        for &key in keys.iter().rev() {
            let Some(id) = self.tree.find(key) else {
                continue;
            };
            let was_visible = self.visible(id);
            let node = self.tree.node_mut(id);
            if node.pins == 0 {
                continue;
            }
            node.pins -= 1;
            if node.pins == 0 {
                self.pinned -= 1;
            }
            self.after_shrink(id, was_visible);
        }
    }

    /// AllBlocksCleared: every residency of one source and its engine-hash map go; its
    /// registration (model, tokenizer) stays. Returns the pairs dropped.
    pub fn clear_source(&mut self, source: SourceKey) -> u64 {
        match self.sources.slot(source) {
            Some(slot) => self.clear_slot(slot),
            None => 0,
        }
    }

    /// Drops every residency source `source` has in `medium` (a tier cleared without
    /// events, e.g. LMCache's `/clear`): as if the engine had sent a BlockRemoved of
    /// that medium for each of those blocks, every reference at once, so the engine-map
    /// entries of the blocks it then holds in no medium go too. Its other media and
    /// its registration stay. Returns the pairs dropped. Visits the source's list, as
    /// [`Index::clear_source`] does.
    pub fn clear_medium(&mut self, source: SourceKey, medium: &Medium) -> u64 {
        let (Some(slot), Some(m)) = (self.sources.slot(source), self.media.resolve(medium)) else {
            return 0;
        };
        let hid = holder_id(slot, m);
        let mut ids = self.sources.get(slot).blocks.clone();
        ids.sort_unstable();
        ids.dedup();
        let mut dropped = 0;
        let mut let_go: BTreeSet<u64> = BTreeSet::new();
        for id in ids {
            let mut set = self.tree.holders(id);
            if set.is_freed() {
                continue;
            }
            let was_visible = self.visible(id);
            if !set.remove_all(&mut self.tree.spills, hid) {
                continue;
            }
            // the claim on the primary hash, if any, went with the source's last holder
            self.tree.set_holders(id, set);
            self.resident_pairs -= 1;
            self.sources.get_mut(slot).pairs -= 1;
            dropped += 1;
            if !self.tree.holders(id).has_slot(&self.tree.spills, slot) {
                let_go.insert(self.tree.key(id));
            }
            self.after_shrink(id, was_visible);
        }
        if !let_go.is_empty() {
            let engine = &mut self.sources.get_mut(slot).engine;
            if !engine.is_empty() {
                engine.retain(|_, key| !let_go.contains(key));
            }
        }
        self.after_letting_go(slot);
        dropped
    }

    /// Drops every source of a worker (all dp ranks), registration included.
    pub fn remove_worker(&mut self, worker: u64) -> u64 {
        let mut dropped = 0;
        for slot in self.sources.slots_of_worker(worker) {
            dropped += self.clear_slot(slot);
            self.sources.remove(slot);
        }
        dropped
    }

    /// Drops every residency of source `slot` and its engine map; returns the pairs
    /// dropped. Visits the nodes on the source's list (`Source::blocks`), not the
    /// slab: O(what the source held), not O(nodes) (docs/index.md, "Removing a
    /// source").
    pub(super) fn clear_slot(&mut self, slot: u32) -> u64 {
        let src = self.sources.get_mut(slot);
        src.engine = Default::default();
        let before = src.pairs;
        let mut ids = std::mem::take(&mut src.blocks);
        // Slab order: neighbouring slots share cache lines (a stored run of blocks
        // has consecutive ids), and duplicates go.
        ids.sort_unstable();
        ids.dedup();
        self.drop_slot_from(slot, &ids);
        let left = self.sources.get(slot).pairs;
        debug_assert_eq!(left, 0, "a held node missing from the source's list");
        if left > 0 {
            // Never expected (the lists are tested against the holders); if it
            // happens, correctness first: one pass over every node.
            let all: Vec<u32> = self.tree.ids().collect();
            self.drop_slot_from(slot, &all);
        }
        before
    }

    /// Records that source `slot` gained its first holder on node `id`. When the
    /// list is full and at least 1.5 × the source's pairs long, it is compacted
    /// first: entries of nodes the source no longer holds (or freed) and
    /// duplicates go, leaving at most `pairs` (so at least a third goes: O(1)
    /// amortised per append). The list grows by a quarter at a time.
    pub(super) fn note_held(&mut self, slot: u32, id: u32) {
        let src = self.sources.get(slot);
        let len = src.blocks.len() as u64;
        if len == src.blocks.capacity() as u64 {
            if len >= 16 && 2 * len >= 3 * src.pairs {
                self.compact_blocks(slot);
            }
            // Grown by a quarter, not doubled: the lists are ~4 bytes per
            // resident pair, and a doubled list is a third empty on average.
            let blocks = &mut self.sources.get_mut(slot).blocks;
            if blocks.len() == blocks.capacity() {
                blocks.reserve_exact((blocks.len() / 4).max(8));
            }
        }
        self.sources.get_mut(slot).blocks.push(id);
    }

    /// After source `slot` let go of nodes (BlockRemoved): once its list is more
    /// than 4 × its pairs (+ 64) long, compact it (at least three quarters go: O(1)
    /// amortised per entry) and give back capacity beyond twice what is left. So
    /// `blocks.len() <= 4 × pairs + 64` always (`check_invariants`), whatever an
    /// engine stored and evicted before.
    pub(super) fn after_letting_go(&mut self, slot: u32) {
        let src = self.sources.get(slot);
        if src.blocks.len() as u64 > 4 * src.pairs + 64 {
            self.compact_blocks(slot);
            let blocks = &mut self.sources.get_mut(slot).blocks;
            if blocks.capacity() > 2 * blocks.len() + 64 {
                blocks.shrink_to(2 * blocks.len() + 64);
            }
        }
    }

    /// Keeps only the entries of nodes the source holds, in slab order, once each.
    fn compact_blocks(&mut self, slot: u32) {
        let mut list = std::mem::take(&mut self.sources.get_mut(slot).blocks);
        list.retain(|&b| self.holds(slot, b));
        list.sort_unstable();
        list.dedup();
        self.sources.get_mut(slot).blocks = list;
    }

    /// Whether node `id` (maybe a freed slot) has a holder of source `slot`.
    #[inline]
    pub(super) fn holds(&self, slot: u32, id: u32) -> bool {
        let set = self.tree.holders(id);
        !set.is_freed() && set.has_slot(&self.tree.spills, slot)
    }

    /// Removes source `slot`'s holders from the nodes `ids` (sorted; freed slots
    /// and nodes it does not hold are skipped), then collects what is left empty.
    fn drop_slot_from(&mut self, slot: u32, ids: &[u32]) {
        const AHEAD: usize = 16;
        #[cfg(test)]
        {
            self.clear_visits += ids.len() as u64;
        }
        let mut emptied = vec![];
        for (i, &id) in ids.iter().enumerate() {
            // The lists name random nodes: start loading later ones (hot and cold
            // parts, then a spilled holder list once its node is in cache).
            if let Some(&far) = ids.get(i + AHEAD) {
                self.tree.prefetch_node(far);
            }
            if let Some(&near) = ids.get(i + AHEAD / 2) {
                let set = self.tree.holders(near);
                if !set.is_freed() {
                    set.prefetch(&self.tree.spills);
                }
            }
            let mut set = self.tree.holders(id);
            if set.is_freed() {
                continue;
            }
            let was_visible = self.visible(id);
            let gone = set.remove_slot(&mut self.tree.spills, slot) as u64;
            if gone == 0 {
                continue;
            }
            self.tree.set_holders(id, set);
            self.resident_pairs -= gone;
            self.sources.get_mut(slot).pairs -= gone;
            if was_visible && !self.visible(id) {
                self.blocks -= 1;
                emptied.push(id);
            }
        }
        // Collect after all holders are gone; an id may already have been freed as
        // the ancestor of another (no node is created meanwhile, so a freed slot
        // is still marked freed). Each collection removes the key and primary hash
        // from their tables: their slots (random lines) are loaded ahead.
        for (i, &id) in emptied.iter().enumerate() {
            if let Some(&far) = emptied.get(i + 2 * AHEAD) {
                self.tree.prefetch_collect(far);
            }
            if let Some(&near) = emptied.get(i + AHEAD) {
                self.tree.prefetch_collect_clusters(near);
            }
            if !self.tree.holders(id).is_freed() {
                self.tree.collect(id);
            }
        }
    }

    /// The complete logical state (see [`LogicalState`]).
    pub fn logical_state(&self) -> LogicalState {
        let mut state = LogicalState::default();
        for id in self.tree.ids() {
            let n = self.tree.node(id);
            let e = self.entry(id);
            state
                .nodes
                .insert(e.key, (e.parent, n.depth(), n.pins, e.holders));
        }
        // Engine maps: explicit entries plus the primary hashes the source claims.
        let mut claims: BTreeMap<u32, Vec<(u64, u64)>> = BTreeMap::new();
        for id in self.tree.ids() {
            if let Some(e) = self.tree.node(id).ehash() {
                for &h in self.tree.holders(id).as_slice(&self.tree.spills) {
                    if claimed(h) {
                        claims
                            .entry(slot_of(id_of(h)))
                            .or_default()
                            .push((e, self.tree.key(id)));
                    }
                }
            }
        }
        for (slot, s) in self.sources.iter() {
            let mut engine: BTreeMap<u64, u64> = s.engine.iter().map(|(&k, &v)| (k, v)).collect();
            engine.extend(claims.remove(&slot).unwrap_or_default());
            state
                .sources
                .insert(s.key, (s.model.clone(), s.tokenizer.clone(), engine));
        }
        state
    }

    /// Same logical state (nodes, holders, pins, sources, engine maps), whatever the
    /// slots and memory layout.
    pub fn state_eq(&self, other: &Self) -> bool {
        self.logical_state() == other.logical_state()
    }

    /// Internal consistency (tests): counters match a recount; links are coherent.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut pairs = 0u64;
        let mut blocks = 0u64;
        let mut pinned = 0u64;
        let mut per_slot: BTreeMap<u32, u64> = BTreeMap::new();
        let live: BTreeSet<u32> = self.tree.ids().collect();
        let mut children: BTreeMap<u32, u32> = BTreeMap::new();
        for &id in &live {
            let p = self.tree.node(id).parent_id;
            if p != NIL {
                *children.entry(p).or_default() += 1;
            }
        }
        for &id in &live {
            let n = self.tree.node(id);
            let key = self.tree.key(id);
            let set = self.tree.holders(id);
            let hs = set.as_slice(&self.tree.spills);
            pairs += hs.len() as u64;
            for &h in hs {
                *per_slot.entry(slot_of(id_of(h))).or_default() += 1;
                if refcount_of(h) == 0 {
                    return Err(format!("node {key:#x}: zero refcount"));
                }
            }
            if !hs.is_empty() || n.pins > 0 {
                blocks += 1;
            } else if n.first_child == NIL {
                return Err(format!("node {key:#x} should have been collected"));
            }
            if n.pins > 0 {
                pinned += 1;
            }
            if n.parent_id != NIL && !live.contains(&n.parent_id) {
                return Err(format!("node {key:#x}: dead parent"));
            }
            let listed: Vec<u32> = self.tree.children(id).collect();
            let distinct: BTreeSet<u32> = listed.iter().copied().collect();
            if children.get(&id).copied().unwrap_or(0) as usize != listed.len()
                || distinct.len() != listed.len()
                || listed.iter().any(|&c| self.tree.node(c).parent_id != id)
            {
                return Err(format!("node {key:#x}: child links off"));
            }
            for &h in hs {
                let slot = slot_of(id_of(h));
                if claimed(h) != set.claimed_by(&self.tree.spills, slot)
                    || (claimed(h) && n.ehash().is_none())
                {
                    return Err(format!("node {key:#x}: inconsistent claim bits"));
                }
            }
            if let Some(e) = n.ehash() {
                if self.tree.find_ehash(e) != Some(id) {
                    return Err(format!("node {key:#x}: ehash not indexed"));
                }
            }
        }
        if (pairs, blocks, pinned) != (self.resident_pairs, self.blocks, self.pinned) {
            return Err(format!(
                "counters {:?} != recount {:?}",
                (self.resident_pairs, self.blocks, self.pinned),
                (pairs, blocks, pinned)
            ));
        }
        let mut held_by: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for &id in &live {
            for &h in self.tree.holders(id).as_slice(&self.tree.spills) {
                held_by.entry(slot_of(id_of(h))).or_default().insert(id);
            }
        }
        for (slot, s) in self.sources.iter() {
            if per_slot.get(&slot).copied().unwrap_or(0) != s.pairs {
                return Err(format!("source {:?}: pairs counter off", s.key));
            }
            let listed: BTreeSet<u32> = s.blocks.iter().copied().collect();
            if let Some(missing) = held_by
                .get(&slot)
                .and_then(|held| held.difference(&listed).next())
            {
                return Err(format!(
                    "source {:?}: holds node {:#x}, not on its list",
                    s.key,
                    self.tree.key(*missing)
                ));
            }
            if s.blocks.len() as u64 > 4 * s.pairs + 64 {
                return Err(format!(
                    "source {:?}: list of {} nodes for {} pairs",
                    s.key,
                    s.blocks.len(),
                    s.pairs
                ));
            }
            for &map_key in s.engine.keys() {
                if let Some(id) = self.tree.find_ehash(map_key) {
                    if self.tree.holders(id).claimed_by(&self.tree.spills, slot) {
                        return Err(format!("source {:?}: entry shadows a claim", s.key));
                    }
                }
            }
        }
        Ok(())
    }
}
