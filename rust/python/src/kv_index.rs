//! `KvIndex`: the residency index over a key-value store (`memory`, `rocksdb`,
//! `holt`; `quillcache_core::backends`) for Python.
//!
//! Same method names and tuple shapes as `NativeIndex`, plus `disk_bytes`, `flush`,
//! `close`. Conversion and GIL release only; every call that touches the store runs
//! with the GIL released.

use std::path::PathBuf;
use std::sync::RwLock;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use quillcache_core::backends::kv_index::KvIndexError;
use quillcache_core::backends::{open_store, KvErrorKind, KvIndex as CoreKvIndex, KvStore};
use quillcache_core::events::Medium;
use quillcache_core::index::{ApplyStats, SourceKey};

use crate::convert::{
    keys_slice, payload_slices, positions_slice, stats_tuple, IndexStatsTuple, StatsTuple,
};
use crate::errors::{closed, CoreError, OrRaise, PayloadFailure};
use crate::reads;

type BoxedKv = CoreKvIndex<Box<dyn KvStore>>;

/// The residency index kept in a key-value store; same methods as `NativeIndex`.
#[pyclass(frozen, module = "quillcache._native", name = "KvIndex")]
pub struct KvIndex {
    inner: RwLock<Option<BoxedKv>>,
    store: String,
}

// Reads go through `reads` (the lock discipline is explained there); writes take the
// write lock the same way: inside `py.detach`.
impl KvIndex {
    fn with_mut<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut BoxedKv) -> Result<T, KvIndexError> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut g = self.inner.write().unwrap_or_else(|e| e.into_inner());
            g.as_mut().map(f)
        })
        .ok_or_else(closed)?
        .or_raise()
    }
}

#[pymethods]
impl KvIndex {
    /// `store`: `memory`, `rocksdb` or `holt` (the latter two need their cargo
    /// feature); `path`: the store's directory; `sync`: fsync every write batch.
    #[new]
    #[pyo3(signature = (store, path=None, *, sync=false))]
    fn new(py: Python<'_>, store: &str, path: Option<PathBuf>, sync: bool) -> PyResult<Self> {
        let p = path.clone();
        let ix = py
            .detach(|| {
                let s = open_store(store, p.as_deref(), sync).map_err(KvIndexError::from)?;
                CoreKvIndex::open(s)
            })
            .or_raise()?;
        Ok(Self {
            inner: RwLock::new(Some(ix)),
            store: store.to_string(),
        })
    }

    #[getter]
    fn store(&self) -> String {
        self.store.clone()
    }

    #[pyo3(signature = (worker, dp_rank=0, *, model="", tokenizer=""))]
    fn register_source(
        &self,
        py: Python<'_>,
        worker: u64,
        dp_rank: u32,
        model: &str,
        tokenizer: &str,
    ) -> PyResult<()> {
        self.with_mut(py, |ix| {
            ix.register_source(SourceKey { worker, dp_rank }, model, tokenizer)
        })
    }

    /// Applies raw batches in order, one atomic write batch each; on a decode error
    /// the earlier ones stay applied and `EventDecodeError` has `payload_index`, `stats`.
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
        let (total, failure) = py
            .detach(|| {
                let mut g = self.inner.write().unwrap_or_else(|e| e.into_inner());
                g.as_mut().map(|ix| {
                    let mut total = ApplyStats::default();
                    for (i, p) in slices.iter().enumerate() {
                        match ix.apply_payload(source, p) {
                            Ok(s) => total += s,
                            Err(e) => return (total, Some((i, e))),
                        }
                    }
                    (total, None)
                })
            })
            .ok_or_else(closed)?;
        match failure {
            None => Ok(stats_tuple(&total)),
            Some((index, KvIndexError::Decode(message))) => Err(PayloadFailure {
                item: None,
                worker,
                index,
                count: slices.len(),
                message,
                applied: total,
            }
            .into()),
            Some((_, e)) => Err(CoreError::from(e).into()),
        }
    }

    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::match_keys(py, &self.inner, keys_slice(&keys)?)
    }

    /// Each candidate's prefix per tier and the match compacted (`reads::match_tiers`).
    #[pyo3(signature = (keys, position, candidates, rank_counts=None, *, all_live=false))]
    fn match_tiers<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
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
            keys_slice(&keys)?,
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
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<reads::MatchColumns<'py>> {
        reads::match_columns(py, &self.inner, keys_slice(&keys)?)
    }

    fn match_many<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<PyReadonlyArray1<'py, u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = requests
            .iter()
            .map(keys_slice)
            .collect::<PyResult<Vec<_>>>()?;
        reads::match_many(py, &self.inner, &keys)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        self.with_mut(py, |ix| ix.remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> PyResult<u64> {
        self.with_mut(py, |ix| ix.clear_source(SourceKey { worker, dp_rank }))
    }

    /// Every residency of (worker, dp_rank) in `medium` dropped (a tier cleared
    /// without events); returns the pairs dropped.
    fn clear_medium(
        &self,
        py: Python<'_>,
        worker: u64,
        dp_rank: u32,
        medium: &str,
    ) -> PyResult<u64> {
        let medium = Medium::parse(Some(medium));
        self.with_mut(py, |ix| {
            ix.clear_medium(SourceKey { worker, dp_rank }, &medium)
        })
    }

    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::scan(py, &self.inner, keys_slice(&prefix)?)
    }

    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        reads::entries(py, &self.inner)
    }

    fn pin(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let keys = keys_slice(&keys)?;
        self.with_mut(py, |ix| ix.pin(keys))
    }

    fn unpin(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let keys = keys_slice(&keys)?;
        self.with_mut(py, |ix| ix.unpin(keys))
    }

    /// `(blocks, nodes, resident_pairs, sources, pinned, spilled=0, memory_bytes,
    /// media_folded)`;
    /// memory is the store's own estimate (memtables, block cache, table readers).
    fn stats(&self, py: Python<'_>) -> PyResult<IndexStatsTuple> {
        reads::stats(py, &self.inner)
    }

    /// Bytes of the store's files.
    fn disk_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        reads::read(py, &self.inner, |ix| ix.store().disk_bytes())
    }

    /// Flushes the store (memtables to files, WAL fsynced).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with_mut(py, |ix| ix.store_mut().flush().map_err(KvIndexError::from))
    }

    /// Flushes and releases the store (a store that refuses calls is only
    /// released). Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = py.detach(|| self.inner.write().unwrap_or_else(|e| e.into_inner()).take());
        match taken {
            None => Ok(()),
            Some(mut ix) => match py.detach(|| ix.store_mut().flush()) {
                // A store that refuses calls reported why when it started to; closing
                // it only releases it.
                Err(e) if e.kind == KvErrorKind::Refused => Ok(()),
                r => r.or_raise(),
            },
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvIndex>()
}
