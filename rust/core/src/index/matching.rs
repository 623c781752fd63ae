//! Longest cached prefix per (source, medium).
//!
//! Walk the request's keys; keep the still-alive holders (sorted ids) and intersect
//! them with each block's sorted holder list; a holder that drops out at block `i`
//! matched `i` blocks. Stops as soon as nobody is left. Only keys are used, never
//! engine hashes.

use std::cell::RefCell;

use super::holders::{id_of, medium_of, slot_of, Holder, HolderId};
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
    /// `match_compact`: the media every live source still holds, holders per
    /// medium, and the media that stop being held by every source at a block.
    full: Vec<u8>,
    counts: Vec<u32>,
    ending: Vec<u8>,
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

/// A match with the leading blocks that every live source holds reported once per
/// medium instead of once per source (docs/index.md, "match_compact"): at 1,024
/// engines sharing a system prompt, 1,024 hits become one floor and the few sources
/// that hold more. [`Index::expand_match`] gives back exactly [`Index::match_keys`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactMatch {
    /// `(medium, blocks)`, in medium name order, `blocks >= 1`: every live source
    /// holds the first `blocks` keys in that medium, and at least one holds no
    /// more. A medium not listed has a floor of 0.
    pub floors: Vec<(u8, u32)>,
    /// Every (source, medium) that holds more leading blocks than its medium's
    /// floor, sorted by (worker, dp rank, medium name) as `match_keys`.
    pub hits: Vec<MatchHit>,
}

impl CompactMatch {
    /// The floor of a medium (0 if it has none).
    pub fn floor(&self, medium: u8) -> u32 {
        self.floors
            .iter()
            .find(|&&(m, _)| m == medium)
            .map_or(0, |&(_, b)| b)
    }
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

    /// The same match as [`Index::match_keys`], with the blocks every live source
    /// holds reported once per medium ([`CompactMatch`]).
    pub fn match_compact(&self, keys: &[u64]) -> CompactMatch {
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.compact_with(keys, &mut scratch),
            Err(_) => self.compact_with(keys, &mut Scratch::default()),
        })
    }

    /// The full, sorted hits of a compact match of this index as it stands (the
    /// floors stand for every live source): `expand_match(&match_compact(k)) ==
    /// match_keys(k)`.
    pub fn expand_match(&self, m: &CompactMatch) -> Vec<MatchHit> {
        if m.floors.is_empty() {
            return m.hits.clone();
        }
        let mut out = Vec::with_capacity(self.sources.len() * m.floors.len() + m.hits.len());
        let mut hits = m.hits.iter().peekable();
        for &(key, _) in self.sources.ordered() {
            let mut floors = m.floors.iter().peekable();
            loop {
                let own = hits
                    .peek()
                    .filter(|h| h.worker == key.worker && h.dp_rank == key.dp_rank);
                let (medium, blocks) = match (own, floors.peek()) {
                    (None, None) => break,
                    (Some(h), None) => (h.medium, h.blocks),
                    (None, Some(&&f)) => f,
                    (Some(h), Some(&&(fm, fb))) => {
                        let (hr, fr) = (self.media.rank(h.medium), self.media.rank(fm));
                        if hr < fr {
                            (h.medium, h.blocks)
                        } else if fr < hr {
                            (fm, fb)
                        } else {
                            // Listed because it holds more than the floor.
                            floors.next();
                            (h.medium, h.blocks)
                        }
                    }
                };
                if own.is_some_and(|h| h.medium == medium) {
                    hits.next();
                } else {
                    floors.next();
                }
                out.push(MatchHit {
                    worker: key.worker,
                    dp_rank: key.dp_rank,
                    medium,
                    blocks,
                });
            }
        }
        debug_assert!(hits.next().is_none(), "a hit of a source that is not live");
        out
    }

    fn compact_with(&self, keys: &[u64], scratch: &mut Scratch) -> CompactMatch {
        scratch.done.clear();
        let floors = self.compact_into(keys, scratch);
        let hits = self.hits_in_order(&scratch.done, &mut scratch.place);
        CompactMatch { floors, hits }
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
            intersect(alive, next, holders.as_slice(spills), done, i as u32 + 1);
        }
        // Whoever is still alive holds every resolved block.
        let n = ids.len() as u32;
        done.extend(alive.iter().map(|&a| (a, n)));
    }

    /// `match_into` with the media that every live source holds kept implicit: while
    /// every live source holds the path so far in medium `m`, none of them is in
    /// `alive`; at the first block that one of them lacks, `m`'s floor is that
    /// depth and the sources that hold that block in `m` become explicit. Returns
    /// the floors, in medium name order; `done` gets the explicit hits.
    fn compact_into(&self, keys: &[u64], scratch: &mut Scratch) -> Vec<(u8, u32)> {
        let Scratch {
            ids,
            alive,
            next,
            done,
            full,
            counts,
            ending,
            ..
        } = scratch;
        ids.clear();
        self.resolve_path(keys, ids);
        let mut floors = Vec::new();
        let spills = &self.tree.spills;
        let Some((&id0, rest)) = ids.split_first() else {
            return floors;
        };
        let live = self.sources.len();
        // The nodes are loaded (resolved); their spilled lists are not, except for
        // the runs `resolve_path` walked: start them all now, so that the walk
        // below does not wait for each in turn.
        for &id in rest {
            self.tree.holders(id).prefetch(spills);
        }
        let mut previous = self.tree.holders(id0);
        let held = previous.as_slice(spills);
        full.clear();
        full.extend(0..self.media.len() as u8);
        self.keep_covered(held, live, full, counts);
        alive.clear();
        // Each medium in `full` has exactly `live` holders here: when they are all
        // of them (a prompt every source holds, in one medium), nothing is explicit
        // and the ~1,024 holders are not read.
        if held.len() != live * full.len() {
            alive.extend(
                held.iter()
                    .map(|&h| id_of(h))
                    .filter(|&id| !full.contains(&medium_of(id))),
            );
        }
        for (i, &id) in rest.iter().enumerate() {
            if alive.is_empty() && full.is_empty() {
                break;
            }
            let holders = self.tree.holders(id);
            if holders == previous {
                continue;
            }
            previous = holders;
            let held = holders.as_slice(spills);
            let depth = i as u32 + 1;
            if !alive.is_empty() {
                intersect(alive, next, held, done, depth);
            }
            if full.is_empty() {
                continue;
            }
            ending.clear();
            ending.extend_from_slice(full);
            self.keep_covered(held, live, full, counts);
            if full.len() == ending.len() {
                continue;
            }
            ending.retain(|m| !full.contains(m));
            floors.extend(ending.iter().map(|&m| (m, depth)));
            // The holders of this block in the media that end here held every
            // block before it: they go on explicitly (other media than `alive`'s,
            // so the merge has no duplicates).
            next.clear();
            let mut a = alive.iter().copied().peekable();
            for h in held.iter().map(|&h| id_of(h)) {
                if !ending.contains(&medium_of(h)) {
                    continue;
                }
                while let Some(x) = a.next_if(|&x| x < h) {
                    next.push(x);
                }
                next.push(h);
            }
            next.extend(a);
            std::mem::swap(alive, next);
        }
        let n = ids.len() as u32;
        floors.extend(full.iter().map(|&m| (m, n)));
        done.extend(alive.iter().map(|&a| (a, n)));
        floors.sort_unstable_by_key(|&(m, _)| self.media.rank(m));
        floors
    }

    /// Keeps in `full` the media in which `held` has every one of the `live`
    /// sources. Each (source, medium) is there at most once and every holder is a
    /// live source, so a medium with `live` holders has all of them; one medium
    /// interned in all (the usual fleet: GPU only), or every medium held by every
    /// source, is known from the length alone.
    fn keep_covered(
        &self,
        held: &[Holder],
        live: usize,
        full: &mut Vec<u8>,
        counts: &mut Vec<u32>,
    ) {
        let media = self.media.len();
        if held.len() < live || live == 0 {
            full.clear();
        } else if media == 1 || held.len() == live * media {
            // Held by every source in every medium: nothing ends.
        } else {
            counts.clear();
            counts.resize(media, 0);
            for &h in held {
                counts[medium_of(id_of(h)) as usize] += 1;
            }
            full.retain(|&m| counts[m as usize] as usize == live);
        }
    }
}

/// Keeps in `alive` the holders that `held` (a block's sorted holders) has; the
/// others matched `depth` blocks and go to `done`.
#[inline]
fn intersect(
    alive: &mut Vec<HolderId>,
    next: &mut Vec<HolderId>,
    held: &[Holder],
    done: &mut Vec<(HolderId, u32)>,
    depth: u32,
) {
    // The same holders as alive (a shared prefix): nobody drops out.
    if held.len() == alive.len() && same_ids(held, alive) {
        return;
    }
    next.clear();
    if held.len() * 16 < alive.len() {
        // Few holders against many alive (a conversation's first block after a
        // system prompt every engine holds): find each holder in `alive`, everyone
        // in between drops out here.
        let mut from = 0;
        for &h in held {
            let id = id_of(h);
            if let Ok(p) = alive[from..].binary_search(&id) {
                let p = from + p;
                done.extend(alive[from..p].iter().map(|&a| (a, depth)));
                next.push(id);
                from = p + 1;
            }
        }
        done.extend(alive[from..].iter().map(|&a| (a, depth)));
    } else if alive.len() * 16 < held.len() {
        // Few alive against many holders (a session's engine meeting a block that
        // every engine holds): find each alive holder in `held`.
        let mut from = 0;
        for &a in alive.iter() {
            let p = from + held[from..].partition_point(|&h| id_of(h) < a);
            if held.get(p).is_some_and(|&h| id_of(h) == a) {
                next.push(a);
                from = p + 1;
            } else {
                done.push((a, depth));
                from = p;
            }
        }
    } else {
        let mut j = 0;
        for &a in alive.iter() {
            while j < held.len() && id_of(held[j]) < a {
                j += 1;
            }
            if j < held.len() && id_of(held[j]) == a {
                next.push(a);
            } else {
                done.push((a, depth));
            }
        }
    }
    std::mem::swap(alive, next);
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
