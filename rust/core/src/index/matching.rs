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
        let mut hits: Vec<MatchHit> = scratch
            .done
            .iter()
            .map(|&(id, blocks)| {
                let src = self.sources.get(slot_of(id)).key;
                MatchHit {
                    worker: src.worker,
                    dp_rank: src.dp_rank,
                    medium: medium_of(id),
                    blocks,
                }
            })
            .collect();
        hits.sort_unstable_by_key(|h| (h.worker, h.dp_rank, self.media.rank(h.medium)));
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
            if held.len() == alive.len()
                && held.iter().zip(alive.iter()).all(|(&h, &a)| id_of(h) == a)
            {
                continue;
            }
            next.clear();
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
