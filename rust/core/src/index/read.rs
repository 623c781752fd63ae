//! The reads every residency index answers alike: the in-memory [`Index`], the
//! crash-safe `persist::DurableIndex` and the key-value `backends::KvIndex`. Callers
//! that only read (the Python binding's classes, comparisons in tests) are written
//! once over [`IndexRead`] instead of once per index.

use std::convert::Infallible;

use crate::events::Medium;

use super::{EntryOut, Index, IndexStats};

/// One (source, medium) of a match with its medium resolved, and how many leading
/// blocks of the request it holds (>= 1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NamedHit {
    pub worker: u64,
    pub dp_rank: u32,
    pub medium: Medium,
    pub blocks: u32,
}

/// Read access to a residency index (`docs/index.md`). `Error` is what the index's
/// storage can fail with ([`Infallible`] in memory).
pub trait IndexRead {
    type Error;

    /// The longest run from block 0 of `keys` that each (source, medium) holds,
    /// sorted by (worker, dp rank, medium name).
    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>, Self::Error>;

    /// Every block with a holder or a pin under the block named by `prefix.last()`
    /// (itself included), sorted by key; every such block for an empty prefix.
    fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>, Self::Error>;

    /// Every block with a holder or a pin, in an order of the index's choosing.
    fn entries(&self) -> Result<Vec<EntryOut>, Self::Error>;

    fn stats(&self) -> Result<IndexStats, Self::Error>;
}

// Each method names `Index::...` explicitly: the inherent methods of the same names
// are the ones meant, never this trait's.
impl IndexRead for Index {
    type Error = Infallible;

    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>, Infallible> {
        Ok(Index::match_keys(self, keys)
            .into_iter()
            .map(|h| NamedHit {
                worker: h.worker,
                dp_rank: h.dp_rank,
                // Cloning a `Medium` of the common kinds copies no string.
                medium: self.medium(h.medium).clone(),
                blocks: h.blocks,
            })
            .collect())
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
