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
        SCRATCH.with(|cell| match cell.try_borrow_mut() {
            Ok(mut scratch) => self.match_with(keys, &mut scratch),
            Err(_) => self.match_with(keys, &mut Scratch::default()),
        })
    }

    fn match_with(&self, keys: &[u64], scratch: &mut Scratch) -> Vec<MatchHit> {
        scratch.done.clear();
        self.match_into(keys, scratch);
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
        hits.sort_unstable_by(|a, b| {
            (a.worker, a.dp_rank, self.media.name(a.medium)).cmp(&(
                b.worker,
                b.dp_rank,
                self.media.name(b.medium),
            ))
        });
        hits
    }

    /// Appends `(holder id, matched blocks)` for every holder with a match >= 1.
    fn match_into(&self, keys: &[u64], scratch: &mut Scratch) {
        let Scratch {
            ids,
            alive,
            next,
            done,
        } = scratch;
        // Pass 1: resolve the keys up to the first unknown one, after prefetching all
        // their table slots and nodes, so that the cache misses overlap.
        ids.clear();
        self.tree.prefetch(keys);
        for &key in keys {
            match self.tree.find(key) {
                Some(id) => ids.push(id),
                None => break,
            }
        }
        let spills = &self.tree.spills;
        let Some((&id0, rest)) = ids.split_first() else {
            return;
        };
        alive.clear();
        alive.extend(
            self.tree
                .node(id0)
                .holders
                .as_slice(spills)
                .iter()
                .map(|&h| id_of(h)),
        );
        // Pass 2: intersect the alive holders with each block's (sorted) holders.
        for (i, &id) in rest.iter().enumerate() {
            if alive.is_empty() {
                return;
            }
            let held = self.tree.node(id).holders.as_slice(spills);
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
