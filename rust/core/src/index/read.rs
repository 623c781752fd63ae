//! The reads every residency index answers alike: the in-memory [`Index`], the
//! crash-safe `persist::DurableIndex` and the key-value `backends::KvIndex`. Callers
//! that only read (the Python binding's classes, comparisons in tests) are written
//! once over [`IndexRead`] instead of once per index.

use std::convert::Infallible;

use crate::events::Medium;

use super::{EntryOut, Index, IndexStats, MatchHit};

/// One (source, medium) of a match with its medium resolved, and how many leading
/// blocks of the request it holds (>= 1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamedHit {
    pub worker: u64,
    pub dp_rank: u32,
    pub medium: Medium,
    pub blocks: u32,
}

/// A match with the blocks every live source holds folded into per-medium floors
/// (`Index::match_compact` with its media resolved).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactHits {
    /// `(medium, blocks)`, `blocks >= 1`: every live source holds the request's first
    /// `blocks` keys in that medium. A medium not listed has a floor of 0.
    pub floors: Vec<(Medium, u32)>,
    /// The (source, medium) pairs holding more than their medium's floor, sorted by
    /// (worker, dp rank, medium name).
    pub hits: Vec<NamedHit>,
}

/// Read access to a residency index (`docs/index.md`). `Error` is what the index's
/// storage can fail with ([`Infallible`] in memory).
pub trait IndexRead {
    type Error;

    /// The longest run from block 0 of `keys` that each (source, medium) holds,
    /// sorted by (worker, dp rank, medium name).
    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>, Self::Error>;

    /// `matches` with the leading blocks that every live source holds in a medium
    /// reported once, as that medium's floor, and only the hits above their medium's
    /// floor ([`CompactHits`]). An index that cannot tell cheaply reports no floors
    /// and every hit (this default).
    fn matches_compact(&self, keys: &[u64]) -> Result<CompactHits, Self::Error> {
        Ok(CompactHits {
            floors: Vec::new(),
            hits: self.matches(keys)?,
        })
    }

    /// Every block with a holder or a pin under the block named by `prefix.last()`
    /// (itself included), sorted by key; every such block for an empty prefix.
    /// Calls `f(worker, dp_rank)` for every source a compact match's floors stand for
    /// (every live source). An index whose `matches_compact` reports no floors need
    /// name none (this default).
    fn floor_holders(&self, f: &mut dyn FnMut(u64, u32)) {
        let _ = f;
    }

    fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>, Self::Error>;

    /// Every block with a holder or a pin, in an order of the index's choosing.
    fn entries(&self) -> Result<Vec<EntryOut>, Self::Error>;

    fn stats(&self) -> Result<IndexStats, Self::Error>;
}

impl Index {
    fn named(&self, h: &MatchHit) -> NamedHit {
        NamedHit {
            worker: h.worker,
            dp_rank: h.dp_rank,
            // Cloning a `Medium` of the common kinds copies no string.
            medium: self.medium(h.medium).clone(),
            blocks: h.blocks,
        }
    }
}

// Each method names `Index::...` explicitly: the inherent methods of the same names
// are the ones meant, never this trait's.
impl IndexRead for Index {
    type Error = Infallible;

    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>, Infallible> {
        Ok(Index::match_keys(self, keys)
            .iter()
            .map(|h| self.named(h))
            .collect())
    }

    fn matches_compact(&self, keys: &[u64]) -> Result<CompactHits, Infallible> {
        let m = Index::match_compact(self, keys);
        Ok(CompactHits {
            floors: m
                .floors
                .iter()
                .map(|&(medium, blocks)| (self.medium(medium).clone(), blocks))
                .collect(),
            hits: m.hits.iter().map(|h| self.named(h)).collect(),
        })
    }

    fn floor_holders(&self, f: &mut dyn FnMut(u64, u32)) {
        for (key, _) in self.sources.ordered() {
            f(key.worker, key.dp_rank);
        }
    }

    fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>, Infallible> {
        Ok(Index::scan(self, prefix))
    }

    fn entries(&self) -> Result<Vec<EntryOut>, Infallible> {
        Ok(Index::entries(self).collect())
    }

    fn stats(&self) -> Result<IndexStats, Infallible> {
        Ok(Index::stats(self))
    }
}
