//! `NativeIndex`: the Rust residency index (`quillcache_core::index`) for Python.
//!
//! Conversion and GIL release only. The index sits behind an `RwLock` so that
//! concurrent Python threads (a gateway's request path and its event ingest) never
//! hit PyO3's borrow errors: matches share the lock, ingest takes it exclusively,
//! and every lock is taken with the GIL released.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};

use quillcache_core::index::{ApplyStats, EntryOut, Index, ReserveError, SourceKey};

use crate::errors::{EventDecodeError, QuillCacheError};
use crate::matches::{match_list, named_hits};

/// `(batches, events, blocks_stored, blocks_removed, clears, orphan_blocks,
/// unknown_removals, invalid_events)`: the fields of `quillcache.index.ApplyStats`.
type StatsTuple = (u64, u64, u64, u64, u64, u64, u64, u64);

/// `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
/// media_folded)`: an index's stats as Python gets them.
pub type IndexStatsTuple = (u64, u64, u64, u64, u64, u64, u64, u64);

fn stats_tuple(s: &ApplyStats) -> StatsTuple {
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

#[pyclass(frozen, module = "quillcache._native", name = "NativeIndex")]
pub struct NativeIndex {
    inner: RwLock<Index>,
}

impl NativeIndex {
    fn read(&self) -> RwLockReadGuard<'_, Index> {
        // A poisoned lock means a panic mid-update; the index is still memory-safe.
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Index> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// The keys, copied while the GIL is held (a request is ~64 keys; the copy is
/// cheaper than numpy's tracked borrow and leaves nothing shared once released).
fn keys_vec(keys: &Bound<'_, PyArray1<u64>>) -> PyResult<Vec<u64>> {
    keys.to_vec()
        .map_err(|_| QuillCacheError::new_err("keys must be a contiguous 1-D uint64 array"))
}

fn entry_tuple<'py>(py: Python<'py>, e: &EntryOut) -> PyResult<Bound<'py, PyTuple>> {
    let holders = PyList::empty(py);
    for h in &e.holders {
        holders.append((h.worker, h.dp_rank, h.medium.as_str(), h.refcount))?;
    }
    (e.key, e.parent, e.depth, holders, e.pinned).into_pyobject(py)
}

#[pymethods]
impl NativeIndex {
    #[new]
    fn new() -> Self {
        Self {
            inner: RwLock::new(Index::new()),
        }
    }

    #[pyo3(signature = (worker, dp_rank=0, *, model="", tokenizer=""))]
    fn register_source(
        &self,
        py: Python<'_>,
        worker: u64,
        dp_rank: u32,
        model: &str,
        tokenizer: &str,
    ) {
        let source = SourceKey { worker, dp_rank };
        py.detach(|| self.write().register_source(source, model, tokenizer));
    }

    /// Decodes and applies raw msgpack batches in order, the GIL released for the
    /// whole list. On a decode error the earlier batches stay applied and
    /// `EventDecodeError` carries `payload_index` and the `stats` applied so far.
    #[pyo3(signature = (worker, payloads, dp_rank=0))]
    fn apply(
        &self,
        py: Python<'_>,
        worker: u64,
        payloads: Vec<Bound<'_, PyBytes>>,
        dp_rank: u32,
    ) -> PyResult<StatsTuple> {
        let slices: Vec<&[u8]> = payloads.iter().map(|b| b.as_bytes()).collect();
        let source = SourceKey { worker, dp_rank };
        let result = py.detach(|| self.write().apply_payloads(source, &slices));
        match result {
            Ok(total) => Ok(stats_tuple(&total)),
            Err(e) => {
                let i = e.index;
                let err = EventDecodeError::new_err(format!(
                    "payload {i} of {} from worker {worker}: {}",
                    slices.len(),
                    e.error
                ));
                let value = err.value(py);
                value.setattr("payload_index", i)?;
                value.setattr("stats", stats_tuple(&e.applied))?;
                Err(err)
            }
        }
    }

    /// `apply` for many `(worker, payloads)` items in order, the GIL released once for
    /// the whole list; a large list is decoded on a second thread while the caller's
    /// applies (`Index::apply_many`), the write lock taken per window of ~8,192 blocks
    /// (a `match` never waits behind the whole list). On a decode error the items before stay applied, and so do
    /// the failing item's payloads before the bad one; `EventDecodeError` carries
    /// `item_index`, `payload_index` and the `stats` of everything applied.
    #[pyo3(signature = (items, dp_rank=0))]
    fn apply_many(
        &self,
        py: Python<'_>,
        items: Vec<(u64, Vec<Bound<'_, PyBytes>>)>,
        dp_rank: u32,
    ) -> PyResult<StatsTuple> {
        let calls: Vec<(SourceKey, Vec<&[u8]>)> = items
            .iter()
            .map(|(worker, payloads)| {
                let source = SourceKey {
                    worker: *worker,
                    dp_rank,
                };
                (source, payloads.iter().map(|b| b.as_bytes()).collect())
            })
            .collect();
        match py.detach(|| Index::apply_many(&calls, || self.write())) {
            Ok(total) => Ok(stats_tuple(&total)),
            Err(e) => {
                let (source, slices) = &calls[e.item];
                let err = EventDecodeError::new_err(format!(
                    "item {}: payload {} of {} from worker {}: {}",
                    e.item,
                    e.payload,
                    slices.len(),
                    source.worker,
                    e.error
                ));
                let value = err.value(py);
                value.setattr("item_index", e.item)?;
                value.setattr("payload_index", e.payload)?;
                value.setattr("stats", stats_tuple(&e.applied))?;
                Err(err)
            }
        }
    }

    /// `[Match, ...]` sorted by (worker, dp_rank, medium); the objects are shared
    /// (`matches.rs`).
    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyArray1<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_vec(keys)?;
        let hits = py.detach(|| named_hits(&self.read(), &keys));
        match_list(py, &hits)
    }

    /// One `match` per request; the GIL is released once for the whole batch.
    fn match_many<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<Bound<'py, PyArray1<u64>>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let slices = requests
            .iter()
            .map(keys_vec)
            .collect::<PyResult<Vec<Vec<u64>>>>()?;
        let all = py.detach(|| {
            slices
                .iter()
                .map(|k| named_hits(&self.read(), k))
                .collect::<Vec<_>>()
        });
        let out = PyList::empty(py);
        for hits in &all {
            out.append(match_list(py, hits)?)?;
        }
        Ok(out)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> u64 {
        py.detach(|| self.write().remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> u64 {
        py.detach(|| self.write().clear_source(SourceKey { worker, dp_rank }))
    }

    /// `[(key, parent, depth, [(worker, dp_rank, medium, refcount), ...], pinned), ...]`
    /// sorted by key.
    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: &Bound<'py, PyArray1<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let prefix = keys_vec(prefix)?;
        let entries = py.detach(|| self.read().scan(&prefix));
        let out = PyList::empty(py);
        for e in &entries {
            out.append(entry_tuple(py, e)?)?;
        }
        Ok(out)
    }

    /// Every block with a holder or a pin (same tuples as `scan`), in no order.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let entries: Vec<EntryOut> = py.detach(|| self.read().entries().collect());
        let out = PyList::empty(py);
        for e in &entries {
            out.append(entry_tuple(py, e)?)?;
        }
        Ok(out)
    }

    fn pin(&self, py: Python<'_>, keys: &Bound<'_, PyArray1<u64>>) -> PyResult<()> {
        let keys = keys_vec(keys)?;
        py.detach(|| self.write().pin(&keys));
        Ok(())
    }

    fn unpin(&self, py: Python<'_>, keys: &Bound<'_, PyArray1<u64>>) -> PyResult<()> {
        let keys = keys_vec(keys)?;
        py.detach(|| self.write().unpin(&keys));
        Ok(())
    }

    /// Pre-sizes the index for `blocks` blocks in all (a capacity hint).
    fn reserve(&self, py: Python<'_>, blocks: u64) -> PyResult<()> {
        py.detach(|| self.write().reserve(blocks))
            .map_err(|e| match e {
                ReserveError::TooLarge { .. } => PyValueError::new_err(e.to_string()),
                ReserveError::OutOfMemory { .. } => PyMemoryError::new_err(e.to_string()),
            })
    }

    /// `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
    /// media_folded)`.
    fn stats(&self, py: Python<'_>) -> IndexStatsTuple {
        let s = py.detach(|| self.read().stats());
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

    /// The whole state as a versioned, checksummed binary snapshot.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let buf = py.detach(|| {
            let mut buf = Vec::new();
            self.read().write_snapshot(&mut buf).map(|_| buf)
        });
        let buf = buf.map_err(|e| QuillCacheError::new_err(format!("snapshot failed: {e}")))?;
        Ok(PyBytes::new(py, &buf))
    }

    /// An index restored from `snapshot()` bytes; corrupt data raises QuillCacheError.
    #[staticmethod]
    fn from_snapshot(py: Python<'_>, data: &[u8]) -> PyResult<Self> {
        let idx = py
            .detach(|| Index::read_snapshot(&mut &data[..]))
            .map_err(|e| QuillCacheError::new_err(e.to_string()))?;
        Ok(Self {
            inner: RwLock::new(idx),
        })
    }

    /// True if both indexes hold the same logical state (tests, recovery checks).
    fn state_eq(&self, py: Python<'_>, other: &NativeIndex) -> bool {
        if std::ptr::eq(self, other) {
            return true;
        }
        py.detach(|| self.read().state_eq(&other.read()))
    }

    /// Internal consistency check (tests): raises QuillCacheError if broken.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.read().check_invariants())
            .map_err(QuillCacheError::new_err)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<NativeIndex>()
}
