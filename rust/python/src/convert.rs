//! Conversions shared by the index classes: numpy keys in, payloads in, and the tuples
//! and lists Python gets back. The shapes are those of `quillcache/_native.pyi`.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use quillcache_core::index::{ApplyStats, EntryOut, IndexStats};

use crate::errors::QuillCacheError;

/// `(batches, events, blocks_stored, blocks_removed, clears, orphan_blocks,
/// unknown_removals, invalid_events)`: the fields of `quillcache.index.ApplyStats`.
pub(crate) type StatsTuple = (u64, u64, u64, u64, u64, u64, u64, u64);

/// `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
/// media_folded)`: an index's stats as Python gets them.
pub(crate) type IndexStatsTuple = (u64, u64, u64, u64, u64, u64, u64, u64);

fn not_keys() -> PyErr {
    QuillCacheError::new_err("keys must be a contiguous 1-D uint64 array")
}

/// The keys, copied while the GIL is held (a request is ~64 keys; the copy is
/// cheaper than numpy's tracked borrow and leaves nothing shared once released).
pub(crate) fn keys_vec(keys: &Bound<'_, PyArray1<u64>>) -> PyResult<Vec<u64>> {
    keys.to_vec().map_err(|_| not_keys())
}

/// The keys, borrowed from numpy for as long as the readonly borrow lives.
pub(crate) fn keys_slice<'a>(keys: &'a PyReadonlyArray1<'_, u64>) -> PyResult<&'a [u64]> {
    keys.as_slice().map_err(|_| not_keys())
}

/// Candidate positions by worker id (`match_tiers`), borrowed from numpy.
pub(crate) fn positions_slice<'a>(
    position: &'a PyReadonlyArray1<'_, isize>,
) -> PyResult<&'a [isize]> {
    position
        .as_slice()
        .map_err(|_| QuillCacheError::new_err("position must be a contiguous 1-D intp array"))
}

/// Raw msgpack batches, borrowed from their `bytes` objects.
pub(crate) fn payload_slices<'a>(payloads: &'a [Bound<'_, PyBytes>]) -> Vec<&'a [u8]> {
    payloads.iter().map(|b| b.as_bytes()).collect()
}

pub(crate) fn stats_tuple(s: &ApplyStats) -> StatsTuple {
    (
        s.batches,
        s.events,
        s.blocks_stored,
        s.blocks_removed,
        s.clears,
        s.orphan_blocks,
        s.unknown_removals,
        s.invalid_events,
    )
}

pub(crate) fn index_stats_tuple(s: &IndexStats) -> IndexStatsTuple {
    (
        s.blocks,
        s.nodes,
        s.resident_pairs,
        s.sources,
        s.pinned,
        s.spilled,
        s.memory_bytes,
        s.media_folded,
    )
}

/// `[(key, parent, depth, [(worker, dp_rank, medium, refcount), ...], pinned), ...]`
/// in the entries' order.
pub(crate) fn entries_list<'py>(
    py: Python<'py>,
    entries: &[EntryOut],
) -> PyResult<Bound<'py, PyList>> {
    let out = PyList::empty(py);
    for e in entries {
        let holders = PyList::empty(py);
        for h in &e.holders {
            holders.append((h.worker, h.dp_rank, h.medium.as_str(), h.refcount))?;
        }
        out.append((e.key, e.parent, e.depth, holders, e.pinned))?;
    }
    Ok(out)
}
