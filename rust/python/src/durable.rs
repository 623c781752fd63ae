//! `DurableIndex`: the crash-safe native index (`quillcache_core::persist`) for Python.
//!
//! Same method names and tuple shapes as `NativeIndex` (so the Python wrapper reuses
//! its conversions), plus `apply(..., seqs=)`, `last_seqs`, `snapshot`, `sync`,
//! `recovery`, `close`. Conversion and GIL release only; every call that touches the
//! index or the disk runs with the GIL released.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use quillcache_core::events::Medium;
use quillcache_core::index::SourceKey;
use quillcache_core::persist::{
    ApplyError, Durability, DurableIndex as CoreDurable, DurableOptions, PersistError,
    SharedDurable, SnapshotTicker, WalOptions,
};

use crate::convert::{
    keys_slice, payload_slices, positions_slice, stats_tuple, IndexStatsTuple, StatsTuple,
};
use crate::errors::{
    closed, CoreError, OrRaise, PayloadFailure, PersistenceError, QuillCacheError,
};
use crate::reads;

#[pyclass(frozen, module = "quillcache._native", name = "DurableIndex")]
pub struct DurableIndex {
    /// Takes time-triggered snapshots while ingest is idle; stopped by `close`.
    /// Declared first: dropped (stopped) before the index it ticks.
    ticker: Mutex<Option<SnapshotTicker>>,
    inner: Arc<SharedDurable>,
    path: PathBuf,
    durability: String,
}

// Reads go through `reads` (the lock discipline is explained there); writes take the
// write lock the same way: inside `py.detach`.
impl DurableIndex {
    fn with_write<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreDurable) -> T + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut g = self.inner.write().unwrap_or_else(|e| e.into_inner());
            g.as_mut().map(f)
        })
        .ok_or_else(closed)
    }

    /// Runs a mutation with the GIL released; maps persistence errors (an I/O error
    /// that left the index refusing changes is a refusal).
    fn mutate<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreDurable) -> Result<T, PersistError> + Send,
    ) -> PyResult<T> {
        self.with_write(py, |d| {
            f(d).map_err(|error| CoreError::Persist {
                error,
                failed: d.failure().is_some(),
            })
        })?
        .or_raise()
    }
}

#[pymethods]
impl DurableIndex {
    /// Opens (or creates) the index in `path` and recovers it (snapshot + log tail).
    #[new]
    #[pyo3(signature = (path, *, durability="interval:10", segment_bytes=64 << 20,
                        snapshot_every_bytes=4 << 20, snapshot_log_ratio=0.125,
                        snapshot_every_ms=60_000,
                        snapshot_in_background=true, snapshot_on_close=true))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        durability: &str,
        segment_bytes: u64,
        snapshot_every_bytes: u64,
        snapshot_log_ratio: f64,
        snapshot_every_ms: u64,
        snapshot_in_background: bool,
        snapshot_on_close: bool,
    ) -> PyResult<Self> {
        let durability = Durability::parse(durability).or_raise()?;
        let opts = DurableOptions {
            wal: WalOptions {
                durability,
                segment_bytes,
            },
            snapshot_every_bytes,
            snapshot_log_ratio,
            snapshot_every: (snapshot_every_ms > 0)
                .then(|| Duration::from_millis(snapshot_every_ms)),
            snapshot_in_background,
            snapshot_on_close,
        };
        if !(snapshot_log_ratio.is_finite() && snapshot_log_ratio >= 0.0) {
            return Err(QuillCacheError::new_err(format!(
                "snapshot_log_ratio must be a finite number >= 0, not {snapshot_log_ratio}"
            )));
        }
        let p = path.clone();
        let d = py.detach(|| CoreDurable::open(&p, opts)).or_raise()?;
        let period = d.tick_period();
        let inner = Arc::new(RwLock::new(Some(d)));
        let ticker = SnapshotTicker::spawn(Arc::downgrade(&inner), period).map_err(|e| {
            PersistenceError::new_err(format!("cannot start the snapshot timer: {e}"))
        })?;
        Ok(Self {
            inner,
            ticker: Mutex::new(Some(ticker)),
            path,
            durability: durability.describe(),
        })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// `none`, `per-batch` or `interval:<ms>`.
    #[getter]
    fn durability(&self) -> String {
        self.durability.clone()
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
        let source = SourceKey { worker, dp_rank };
        self.mutate(py, |d| d.register_source(source, model, tokenizer))
    }

    /// Decodes, logs (one write) and applies raw msgpack batches in order. `seqs`: the
    /// engine's sequence number of each batch. On a decode error the earlier batches
    /// stay applied (and logged); `EventDecodeError` carries `payload_index` and `stats`.
    #[pyo3(signature = (worker, payloads, dp_rank=0, seqs=None))]
    fn apply(
        &self,
        py: Python<'_>,
        worker: u64,
        payloads: Vec<Bound<'_, PyBytes>>,
        dp_rank: u32,
        seqs: Option<Vec<u64>>,
    ) -> PyResult<StatsTuple> {
        let slices = payload_slices(&payloads);
        let source = SourceKey { worker, dp_rank };
        let result = self.with_write(py, |d| {
            d.apply(source, &slices, seqs.as_deref())
                .map_err(|e| match e {
                    ApplyError::Persist(error) => CoreError::Persist {
                        error,
                        failed: d.failure().is_some(),
                    },
                    ApplyError::Decode {
                        index,
                        message,
                        applied,
                    } => PayloadFailure {
                        item: None,
                        worker,
                        index,
                        count: slices.len(),
                        message,
                        applied,
                    }
                    .into(),
                })
        })?;
        result.map(|stats| stats_tuple(&stats)).or_raise()
    }

    /// `[Match, ...]` sorted by (worker, dp_rank, medium).
    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::match_keys(py, &*self.inner, keys_slice(&keys)?)
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
            &*self.inner,
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
        reads::match_columns(py, &*self.inner, keys_slice(&keys)?)
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
        reads::match_many(py, &*self.inner, &keys)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        self.mutate(py, |d| d.remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> PyResult<u64> {
        self.mutate(py, |d| d.clear_source(SourceKey { worker, dp_rank }))
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
        self.mutate(py, |d| {
            d.clear_medium(SourceKey { worker, dp_rank }, &medium)
        })
    }

    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        reads::scan(py, &*self.inner, keys_slice(&prefix)?)
    }

    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        reads::entries(py, &*self.inner)
    }

    fn pin(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let keys = keys_slice(&keys)?;
        self.mutate(py, |d| d.pin(keys))
    }

    fn unpin(&self, py: Python<'_>, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        let keys = keys_slice(&keys)?;
        self.mutate(py, |d| d.unpin(keys))
    }

    /// `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
    /// media_folded)`.
    fn stats(&self, py: Python<'_>) -> PyResult<IndexStatsTuple> {
        reads::stats(py, &*self.inner)
    }

    /// `{(worker, dp_rank): seq}`: the last engine sequence number applied per source.
    fn last_seqs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let seqs: Vec<(SourceKey, u64)> = reads::read(py, &*self.inner, |d| {
            d.last_seqs().iter().map(|(s, seq)| (*s, *seq)).collect()
        })?;
        let out = PyDict::new(py);
        for (s, seq) in seqs {
            out.set_item((s.worker, s.dp_rank), seq)?;
        }
        Ok(out)
    }

    /// Writes a snapshot now and prunes the log it covers; returns the lsn covered.
    fn snapshot(&self, py: Python<'_>) -> PyResult<u64> {
        self.mutate(py, |d| d.snapshot())
    }

    /// fsyncs the log now; returns the lsn now durable.
    fn sync(&self, py: Python<'_>) -> PyResult<u64> {
        self.mutate(py, |d| d.sync())
    }

    /// The in-memory index image (`NativeIndex.from_snapshot` reads it): for checks.
    fn index_image<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let buf = reads::read(py, &*self.inner, |d| {
            let mut buf = Vec::new();
            d.index().write_snapshot(&mut buf).map(|_| buf)
        })?
        .map_err(|e| PersistenceError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &buf))
    }

    /// What recovery did: snapshot lsn and bytes, records replayed, torn tail, timings.
    fn recovery<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = reads::read(py, &*self.inner, |d| d.recovery().clone())?;
        let secs = |d: Duration| d.as_secs_f64();
        let out = PyDict::new(py);
        out.set_item("snapshot_lsn", r.snapshot_lsn)?;
        out.set_item("snapshot_bytes", r.snapshot_bytes)?;
        out.set_item("snapshot_load_s", secs(r.snapshot_load))?;
        out.set_item("wal_segments", r.wal.segments)?;
        out.set_item("wal_records_read", r.wal.records_read)?;
        out.set_item("wal_records_replayed", r.wal.records_replayed)?;
        out.set_item("wal_bytes_read", r.wal.bytes_read)?;
        out.set_item("wal_replay_s", secs(r.wal_replay))?;
        out.set_item("last_lsn", r.wal.last_lsn)?;
        out.set_item("total_s", secs(r.total))?;
        match &r.wal.torn_tail {
            Some(t) => {
                let torn = PyDict::new(py);
                torn.set_item("path", &t.path)?;
                torn.set_item("offset", t.offset)?;
                torn.set_item("bytes_dropped", t.bytes_dropped)?;
                torn.set_item("reason", t.reason)?;
                out.set_item("torn_tail", torn)?;
            }
            None => out.set_item("torn_tail", py.None())?,
        }
        Ok(out)
    }

    /// `{last_lsn, synced_lsn, snapshot_lsn, disk_bytes, failure, snapshot_error}`.
    fn wal_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (last, synced, snapshot, disk, failure, snapshot_error) =
            reads::read(py, &*self.inner, |d| {
                let disk = d.disk_bytes();
                (
                    d.last_lsn(),
                    d.synced_lsn(),
                    d.snapshot_lsn(),
                    disk,
                    d.failure(),
                    d.snapshot_error().map(str::to_string),
                )
            })?;
        let out = PyDict::new(py);
        out.set_item("last_lsn", last)?;
        out.set_item("synced_lsn", synced)?;
        out.set_item("snapshot_lsn", snapshot)?;
        out.set_item("disk_bytes", disk)?;
        out.set_item("failure", failure)?;
        out.set_item("snapshot_error", snapshot_error)?;
        Ok(out)
    }

    /// Snapshot (unless disabled), fsync, release the directory. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let taken = py.detach(|| {
            if let Some(mut t) = self.ticker.lock().unwrap_or_else(|e| e.into_inner()).take() {
                t.stop();
            }
            self.inner.write().unwrap_or_else(|e| e.into_inner()).take()
        });
        match taken {
            None => Ok(()),
            Some(d) => py.detach(|| d.close()).or_raise(),
        }
    }

    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DurableIndex>()
}
