//! `NativeIndex`: the Rust residency index (`quillcache_core::index`) for Python.
//!
//! Conversion and GIL release only. The index sits behind an `RwLock` so that
//! concurrent Python threads (a gateway's request path and its event ingest) never
//! hit PyO3's borrow errors: matches share the lock, ingest takes it exclusively,
//! and every lock is taken with the GIL released.

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use quillcache_core::events::Medium;
use quillcache_core::index::{Index, SourceKey};

use crate::convert::{
    keys_vec, payload_slices, positions_slice, stats_tuple, IndexStatsTuple, StatsTuple,
};
use crate::errors::{OrRaise, PayloadFailure, QuillCacheError};
use crate::reads;

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
        let slices = payload_slices(&payloads);
        let source = SourceKey { worker, dp_rank };
        py.detach(|| self.write().apply_payloads(source, &slices))
            .map(|total| stats_tuple(&total))
            .map_err(|e| {
                PayloadFailure {
                    item: None,
                    worker,
                    index: e.index,
                    count: slices.len(),
                    message: e.error.to_string(),
                    applied: e.applied,
                }
                .into()
            })
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
                (source, payload_slices(payloads))
            })
            .collect();
        py.detach(|| Index::apply_many(&calls, || self.write()))
            .map(|total| stats_tuple(&total))
            .map_err(|e| {
                let (source, slices) = &calls[e.item];
                PayloadFailure {
                    item: Some(e.item),
                    worker: source.worker,
                    index: e.payload,
                    count: slices.len(),
                    message: e.error.to_string(),
                    applied: e.applied,
                }
                .into()
            })
    }

    /// `[Match, ...]` sorted by (worker, dp_rank, medium); the objects are shared
    /// (`matches.rs`).
    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyArray1<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::match_keys(py, &self.inner, &keys_vec(keys)?)
    }

    /// Each candidate's prefix per tier and the match compacted (`reads::match_tiers`).
    #[pyo3(signature = (keys, position, candidates, rank_counts=None, *, all_live=false))]
    fn match_tiers<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyArray1<u64>>,
        position: PyReadonlyArray1<'py, isize>,
        candidates: usize,
        rank_counts: Option<PyReadonlyArray1<'py, isize>>,
        all_live: bool,
    ) -> PyResult<reads::MatchTiers<'py>> {
        let counts = match &rank_counts {
            Some(c) => Some(positions_slice(c)?),
            None => None,
        };
        reads::match_tiers(
            py,
            &self.inner,
            &keys_vec(keys)?,
            positions_slice(&position)?,
            candidates,
            counts,
            all_live,
        )
    }

    /// `match` as arrays (`reads::match_columns`).
    fn match_columns<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyArray1<u64>>,
    ) -> PyResult<reads::MatchColumns<'py>> {
        reads::match_columns(py, &self.inner, &keys_vec(keys)?)
    }

    /// One `match` per request; the GIL is released once for the whole batch.
    fn match_many<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<Bound<'py, PyArray1<u64>>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = requests
            .iter()
            .map(keys_vec)
            .collect::<PyResult<Vec<_>>>()?;
        reads::match_many(py, &self.inner, &keys)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> u64 {
        py.detach(|| self.write().remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> u64 {
        py.detach(|| self.write().clear_source(SourceKey { worker, dp_rank }))
    }

    /// Every residency of (worker, dp_rank) in `medium` dropped (a tier cleared
    /// without events); returns the pairs dropped.
    fn clear_medium(&self, py: Python<'_>, worker: u64, dp_rank: u32, medium: &str) -> u64 {
        let medium = Medium::parse(Some(medium));
        py.detach(|| {
            self.write()
                .clear_medium(SourceKey { worker, dp_rank }, &medium)
        })
    }

    /// `[(key, parent, depth, [(worker, dp_rank, medium, refcount), ...], pinned), ...]`
    /// sorted by key.
    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: &Bound<'py, PyArray1<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::scan(py, &self.inner, &keys_vec(prefix)?)
    }

    /// Every block with a holder or a pin (same tuples as `scan`), in no order.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        reads::entries(py, &self.inner)
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
        py.detach(|| self.write().reserve(blocks)).or_raise()
    }

    /// `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
    /// media_folded)`.
    fn stats(&self, py: Python<'_>) -> PyResult<IndexStatsTuple> {
        reads::stats(py, &self.inner)
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
            .or_raise()?;
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
