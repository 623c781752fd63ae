//! Longest cached prefix per (source, medium).
//!
//! Walk the request's keys; keep the still-alive holders (sorted ids) and intersect
//! them with each block's sorted holder list; a holder that drops out at block `i`
//! matched `i` blocks. Stops as soon as nobody is left. Only keys are used, never
//! engine hashes.

use std::cell::RefCell;

use super::holders::{id_of, medium_of, slot_of, HolderId};
use super::Index;

/// Per-thread scratch buffers, so that a match allocates only its result.
#[derive(Default)]
struct Scratch {
    ids: Vec<u32>,
    alive: Vec<HolderId>,
    next: Vec<HolderId>,
    done: Vec<(HolderId, u32)>,
    /// `place[rank * media + medium rank]`: where a hit sits in `done`, `u32::MAX`
    /// between calls (see `Index::hits_in_order`).
    place: Vec<u32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::default();
}

/// How `match` finds the nodes of a request's keys (both give the same result;
/// the choice is exposed for side-by-side benchmarks and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathLookup {
    /// Runs of consecutive slab slots first, then the table (`match_keys`' way).
    Runs,
    /// Every key through the table, all slots and nodes prefetched first.
    Table,
}

/// One (source, medium) and how many leading blocks of the request it holds (>= 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatchHit {
    pub worker: u64,
    pub dp_rank: u32,
    /// Interned medium index; [`Index::medium_name`] gives its name.
    pub medium: u8,
    pub blocks: u32,
}

impl Index {
    /// Sorted by (worker, dp rank, medium name).
    pub fn match_keys(&self, keys: &[u64]) -> Vec<MatchHit> {
        self.match_keys_using(keys, PathLookup::Runs)
    }

    /// `match_keys` with a given way of finding the keys' nodes.
    pub fn match_keys_using(&self, keys: &[u64], lookup: PathLookup) -> Vec<MatchHit> {
        let resolve = match lookup {
            PathLookup::Runs => Self::resolve_path,
            PathLookup::Table => Self::resolve_through_table,
        };
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.match_with(keys, &mut scratch, resolve),
            Err(_) => self.match_with(keys, &mut Scratch::default(), resolve),
        })
    }

    /// `match_keys` resolving every key through the table, one at a time, without
    /// prefetching (the plainest reference, for tests).
    #[cfg(test)]
    pub(super) fn match_keys_table_only(&self, keys: &[u64]) -> Vec<MatchHit> {
        let table_only = |idx: &Self, keys: &[u64], ids: &mut Vec<u32>| {
            ids.extend(keys.iter().map_while(|&k| idx.tree.find(k)));
        };
        self.match_with(keys, &mut Scratch::default(), table_only)
    }

    fn match_with(
        &self,
        keys: &[u64],
        scratch: &mut Scratch,
        resolve: impl Fn(&Self, &[u64], &mut Vec<u32>),
    ) -> Vec<MatchHit> {
        scratch.done.clear();
        self.match_into(keys, scratch, resolve);
        self.hits_in_order(&scratch.done, &mut scratch.place)
    }

    /// The hits of `done`, sorted by (worker, dp rank, medium name). Each (source,
    /// medium) is there once, so its place in that order, `rank of the source ×
    /// media + rank of the medium`, is a distinct small integer: when the hits are
    /// many (every engine holds a fleet's system prompt: ~1,024 hits per request)
    /// they are put at those places and read back in order, O(hits + sources ×
    /// media), instead of a comparison sort (which was half of such a match).
    fn hits_in_order(&self, done: &[(HolderId, u32)], place: &mut Vec<u32>) -> Vec<MatchHit> {
        let ordered = self.sources.ordered();
        let media = self.media.len().max(1);
        let hit = |&(id, blocks): &(HolderId, u32)| {
            let src = ordered[self.sources.rank(slot_of(id)) as usize].0;
            MatchHit {
                worker: src.worker,
                dp_rank: src.dp_rank,
                medium: medium_of(id),
                blocks,
            }
        };
        let places = ordered.len() * media;
        if done.len() < 64 || places > 16 * done.len() {
            let mut hits: Vec<MatchHit> = done.iter().map(hit).collect();
            hits.sort_unstable_by_key(|h| (h.worker, h.dp_rank, self.media.rank(h.medium)));
            return hits;
        }
        if place.len() < places {
            place.resize(places, u32::MAX);
        }
        for (i, &(id, _)) in done.iter().enumerate() {
            let at = self.sources.rank(slot_of(id)) as usize * media
                + self.media.rank(medium_of(id)) as usize;
            place[at] = i as u32;
        }
        let mut hits = Vec::with_capacity(done.len());
        for p in &mut place[..places] {
            if *p != u32::MAX {
                hits.push(hit(&done[*p as usize]));
                *p = u32::MAX;
            }
        }
        hits
    }

    /// The node ids of `keys` up to the first unknown key.
    ///
    /// The blocks of one BlockStored are inserted one after another, so a path is
    /// mostly runs of consecutive slab slots. After a key found through the table,
    /// the following keys are tried at the following slots (prefetched together:
    /// one sequential stream instead of a table probe and a node read per key).
    /// After `TABLE_RUNS` runs the path looks fragmented (blocks stored by many
    /// events, slots reused), and the rest is resolved through the table with every
    /// slot and node prefetched first, so that those misses overlap. A path of a
    /// few long runs (a shared prompt, then one long store) gains; a path of many
    /// short runs pays a little for the guess (docs/results/residency-index.md).
    fn resolve_path(&self, keys: &[u64], ids: &mut Vec<u32>) {
        const TABLE_RUNS: usize = 2;
        let tree = &self.tree;
        // Every key's table slot first, so that a run's first key costs one miss
        // (its node) rather than two; all but the first into L2 only: a path of
        // runs reads few of them, and L1 prefetches would hold the miss buffers
        // that the runs' stream needs (docs/results/residency-index.md).
        let Some((&first, rest)) = keys.split_first() else {
            return;
        };
        tree.prefetch_slot(first);
        tree.prefetch_slots_to_l2(rest);
        let mut i = 0;
        for _ in 0..TABLE_RUNS {
            let Some(&key) = keys.get(i) else {
                return;
            };
            let Some(mut id) = tree.find(key) else {
                return;
            };
            ids.push(id);
            i += 1;
            tree.prefetch_hot(id.wrapping_add(1), keys.len() - i);
            // A shared prefix's blocks have spilled holder lists: start loading
            // them now, so that the intersection below finds them in cache.
            tree.holders(id).prefetch(&tree.spills);
            while let Some(next) = keys
                .get(i)
                .and_then(|&k| tree.live_node_with_key(id.wrapping_add(1), k))
            {
                ids.push(next);
                tree.holders(next).prefetch(&tree.spills);
                id = next;
                i += 1;
            }
        }
        self.resolve_through_table(&keys[i.min(keys.len())..], ids);
    }

    /// The node ids of `keys` up to the first unknown key, through the table, with
    /// every slot and then every tag-matching node prefetched first.
    fn resolve_through_table(&self, keys: &[u64], ids: &mut Vec<u32>) {
        self.tree.prefetch(keys);
        for &key in keys {
            match self.tree.find(key) {
                Some(id) => ids.push(id),
                None => return,
            }
        }
    }

    /// Appends `(holder id, matched blocks)` for every holder with a match >= 1.
    fn match_into(
        &self,
        keys: &[u64],
        scratch: &mut Scratch,
        resolve: impl Fn(&Self, &[u64], &mut Vec<u32>),
    ) {
        let Scratch {
            ids,
            alive,
            next,
            done,
            ..
        } = scratch;
        ids.clear();
        resolve(self, keys, ids);
        let spills = &self.tree.spills;
        let Some((&id0, rest)) = ids.split_first() else {
            return;
        };
        let mut previous = self.tree.holders(id0);
        alive.clear();
        alive.extend(previous.as_slice(spills).iter().map(|&h| id_of(h)));
        // Pass 2: intersect the alive holders with each block's (sorted) holders.
        for (i, &id) in rest.iter().enumerate() {
            if alive.is_empty() {
                return;
            }
            let holders = self.tree.holders(id);
            // The same set as the previous block's (one inline holder with the same
            // refcount: a session's own blocks): alive, a subset of it, is unchanged.
            if holders == previous {
                continue;
            }
            previous = holders;
            let held = holders.as_slice(spills);
            // Fast path: same holder set as the previous block (a shared prefix).
            if held.len() == alive.len() && same_ids(held, alive) {
                continue;
            }
            next.clear();
            if held.len() * 16 < alive.len() {
                // Few holders against many alive (a conversation's first block
                // after a system prompt every engine holds): find each holder in
                // `alive`, everyone in between drops out here.
                let mut from = 0;
                for &h in held {
                    let id = id_of(h);
                    if let Ok(p) = alive[from..].binary_search(&id) {
                        let p = from + p;
                        done.extend(alive[from..p].iter().map(|&a| (a, i as u32 + 1)));
                        next.push(id);
                        from = p + 1;
                    }
                }
                done.extend(alive[from..].iter().map(|&a| (a, i as u32 + 1)));
                std::mem::swap(alive, next);
                continue;
            }
            let mut j = 0;
            for &a in alive.iter() {
                while j < held.len() && id_of(held[j]) < a {
                    j += 1;
                }
                if j < held.len() && id_of(held[j]) == a {
                    next.push(a);
                } else {
                    done.push((a, i as u32 + 1));
                }
            }
            std::mem::swap(alive, next);
        }
        // Whoever is still alive holds every resolved block.
        let n = ids.len() as u32;
        done.extend(alive.iter().map(|&a| (a, n)));
    }
}

/// Whether `held`'s ids are `alive`, in chunks without an early exit, so that the
/// compiler vectorises it (a shared prompt's blocks each have ~1,024 holders).
#[inline]
fn same_ids(held: &[u64], alive: &[HolderId]) -> bool {
    const CHUNK: usize = 16;
    let mut h = held.chunks_exact(CHUNK);
    let mut a = alive.chunks_exact(CHUNK);
    for (hc, ac) in (&mut h).zip(&mut a) {
        let mut diff = 0u32;
        for i in 0..CHUNK {
            diff |= id_of(hc[i]) ^ ac[i];
        }
        if diff != 0 {
            return false;
        }
    }
    h.remainder()
        .iter()
        .zip(a.remainder())
        .all(|(&h, &a)| id_of(h) == a)
}
