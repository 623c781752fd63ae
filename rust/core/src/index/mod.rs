//! The residency index: which source (worker, dp rank) holds which block, in which
//! medium; longest-prefix match per (source, medium); subtree scans; pins.
//!
//! Semantics are specified in `docs/index.md`; the Python reference
//! (`quillcache/index/memory.py`) implements the same rules and the property tests
//! compare the two on random event streams.
//!
//! * [`holders`]: the compact per-block holder set.
//! * [`tree`]: nodes in a slab, found by content key.
//! * [`keytable`]: the open-addressing `key → node` table, with prefetch.
//! * [`hugepages`]: transparent huge pages for the slab and the tables.
//! * [`sources`]: sources, their engine-hash maps, interned media.
//! * [`apply`]: BlockStored / BlockRemoved / AllBlocksCleared.
//! * [`batch`]: many payloads at once, probes overlapped across events.
//! * [`matching`]: the longest cached prefix per (source, medium).
//! * [`scan`]: subtree scans, entries, pins, removal of sources.
//! * [`read`]: the reads every residency index shares ([`IndexRead`]).
//! * [`snapshot`]: a versioned, checksummed binary image of the whole state.

mod apply;
mod batch;
pub mod holders;
mod hugepages;
mod keytable;
mod many;
mod matching;
mod read;
mod scan;
mod snapshot;
pub mod sources;
mod tree;

#[cfg(test)]
mod churn_tests;
#[cfg(test)]
mod removal_tests;
#[cfg(test)]
mod tests;

pub use batch::PayloadsError;
pub use many::ManyError;
pub use matching::{CompactMatch, MatchHit, PathLookup};
pub use read::{CompactHits, IndexRead, NamedHit};
pub use scan::{EntryOut, HolderOut, LogicalState};
pub use snapshot::SnapshotError;
pub use sources::SourceKey;

use crate::events::Medium;
use sources::{Media, Sources};
use tree::Tree;

/// What applying event batches did; the counters add up over batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyStats {
    pub batches: u64,
    pub events: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    /// Stored with an unknown parent, or without tokens and with an unknown hash.
    pub orphan_blocks: u64,
    /// BlockRemoved of a hash the source does not hold in that medium.
    pub unknown_removals: u64,
    /// Well-formed events that make no sense (too few tokens, block_size 0, ...).
    pub invalid_events: u64,
}

impl std::ops::AddAssign for ApplyStats {
    fn add_assign(&mut self, o: Self) {
        self.batches += o.batches;
        self.events += o.events;
        self.blocks_stored += o.blocks_stored;
        self.blocks_removed += o.blocks_removed;
        self.clears += o.clears;
        self.orphan_blocks += o.orphan_blocks;
        self.unknown_removals += o.unknown_removals;
        self.invalid_events += o.invalid_events;
    }
}

/// Sizes of the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IndexStats {
    /// Blocks with a holder or a pin (what `entries` reports).
    pub blocks: u64,
    /// Every node, including holder-less interior nodes kept for their children.
    pub nodes: u64,
    pub resident_pairs: u64,
    pub sources: u64,
    pub pinned: u64,
    /// Nodes whose holders spilled to the arena (more than one holder).
    pub spilled: u64,
    /// Heap bytes of every structure of the index (capacities, not just lengths).
    pub memory_bytes: u64,
    /// Stored events whose medium name was beyond the limits (too long, or one
    /// unknown name too many) and went to the `OTHER` medium.
    pub media_folded: u64,
}

/// The largest capacity hint `Index::reserve` takes: 2^26 blocks (the two tables
/// then take 1 GiB at once; the slab ~2.7 GB as it fills).
pub const MAX_RESERVE_BLOCKS: u64 = 1 << 26;

/// Why `Index::reserve` refused a hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveError {
    TooLarge { blocks: u64 },
    OutOfMemory { blocks: u64 },
}

impl std::fmt::Display for ReserveError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooLarge { blocks } => write!(
                f,
                "capacity hint of {blocks} blocks is above the maximum of {MAX_RESERVE_BLOCKS}"
            ),
            Self::OutOfMemory { blocks } => {
                write!(f, "not enough memory to reserve room for {blocks} blocks")
            }
        }
    }
}

impl std::error::Error for ReserveError {}

/// The residency index. See the module docs and `docs/index.md`.
#[derive(Debug, Clone, Default)]
pub struct Index {
    tree: Tree,
    sources: Sources,
    media: Media,
    /// See [`IndexStats::media_folded`] (not in snapshots: a counter since start).
    media_folded: u64,
    resident_pairs: u64,
    /// Nodes with a holder or a pin.
    blocks: u64,
    pinned: u64,
    /// Nodes visited by `clear_slot` since creation (tests: a removal visits what
    /// the source held, not the slab).
    #[cfg(test)]
    clear_visits: u64,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the model and tokenizer of a source: the base of its events' namespace.
    pub fn register_source(&mut self, source: SourceKey, model: &str, tokenizer: &str) {
        if let Some(slot) = self.sources.slot_or_create(source, holders::MAX_SLOT) {
            let s = self.sources.get_mut(slot);
            s.model = model.to_string();
            s.tokenizer = tokenizer.to_string();
        }
    }

    /// Pre-sizes the index for `blocks` blocks in all: a capacity hint (a connector
    /// knows its engines' cache sizes, a restore its snapshot's), so that ingest up
    /// to that size never re-places the tables or moves the slab. The memory is
    /// taken now (and counted in `memory_bytes`); the index still grows beyond.
    /// Hints above [`MAX_RESERVE_BLOCKS`], or memory that is not there, are an
    /// error that leaves the index as it was (maybe with some capacity added).
    pub fn reserve(&mut self, blocks: u64) -> Result<(), ReserveError> {
        if blocks > MAX_RESERVE_BLOCKS {
            return Err(ReserveError::TooLarge { blocks });
        }
        self.tree
            .reserve(blocks as usize)
            .map_err(|_| ReserveError::OutOfMemory { blocks })
    }

    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks,
            nodes: self.tree.len() as u64,
            resident_pairs: self.resident_pairs,
            sources: self.sources.len() as u64,
            pinned: self.pinned,
            spilled: self.tree.spills.in_use() as u64,
            memory_bytes: (std::mem::size_of::<Self>()
                + self.tree.heap_bytes()
                + self.sources.heap_bytes()
                + self.media.heap_bytes()) as u64,
            media_folded: self.media_folded,
        }
    }

    /// Name of an interned medium index (as found in [`MatchHit::medium`]).
    pub fn medium_name(&self, medium: u8) -> &str {
        self.media.name(medium)
    }

    /// An interned medium (as found in [`MatchHit::medium`]).
    pub fn medium(&self, medium: u8) -> &Medium {
        &self.media.all()[medium as usize]
    }

    /// A node gained or lost its holder/pin status: keep `blocks` exact.
    fn visible(&self, id: u32) -> bool {
        !self.tree.holders(id).is_empty() || self.tree.node(id).pins > 0
    }
}
