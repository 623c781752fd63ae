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

use crate::matches::{match_list, named_hits, Hit};
use pyo3::types::{PyBytes, PyDict, PyList};

use quillcache_core::backends::kv_index::KvIndexError;
use quillcache_core::backends::{open_store, KvErrorKind, KvIndex as CoreKvIndex, KvStore};
use quillcache_core::events::Medium;
use quillcache_core::index::{ApplyStats, EntryOut, SourceKey};
use quillcache_core::persist::{
    ApplyError, Durability, DurableIndex as CoreDurable, DurableOptions, PersistError,
    SharedDurable, SnapshotTicker, WalOptions,
};

use crate::errors::{
    CorruptIndexError, EventDecodeError, IndexLockedError, IngestRefusedError, PersistenceError,
    QuillCacheError,
};

fn to_py(e: PersistError, failed: bool) -> PyErr {
    let msg = e.to_string();
    match e {
        PersistError::CorruptLog { .. }
        | PersistError::CorruptSnapshot { .. }
        | PersistError::Replay { .. } => CorruptIndexError::new_err(msg),
        PersistError::Locked { .. } => IndexLockedError::new_err(msg),
        PersistError::Failed { .. } => IngestRefusedError::new_err(msg),
        PersistError::InvalidOption(_) => QuillCacheError::new_err(msg),
        PersistError::Io { .. } if failed => IngestRefusedError::new_err(format!(
            "{msg}; nothing of this call was applied and the index refuses further \
             changes (reopen once the cause is fixed)"
        )),
        PersistError::Io { .. } => PersistenceError::new_err(msg),
    }
}

type StatsTuple = (u64, u64, u64, u64, u64, u64, u64, u64);

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

/// `EventDecodeError` for payload `index` of `count` from `worker`, carrying
/// `payload_index` and the stats of the batches applied before it (both indexes).
fn decode_error(
    py: Python<'_>,
    worker: u64,
    index: usize,
    count: usize,
    message: &str,
    applied: &ApplyStats,
) -> PyErr {
    let err = EventDecodeError::new_err(format!(
        "payload {index} of {count} from worker {worker}: {message}"
    ));
    let value = err.value(py);
    // Setting attributes on a fresh exception instance cannot fail in practice;
    // if it did, the error without them is still the right one to raise.
    let _ = value.setattr("payload_index", index);
    let _ = value.setattr("stats", stats_tuple(applied));
    err
}

fn keys_slice<'a>(keys: &'a PyReadonlyArray1<'_, u64>) -> PyResult<&'a [u64]> {
    keys.as_slice()
        .map_err(|_| QuillCacheError::new_err("keys must be a contiguous 1-D uint64 array"))
}

fn entries_list<'py>(py: Python<'py>, entries: &[EntryOut]) -> PyResult<Bound<'py, PyList>> {
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

#[pyclass(frozen, module = "quillcache._native", name = "DurableIndex")]
pub struct DurableIndex {
    /// Takes time-triggered snapshots while ingest is idle; stopped by `close`.
    /// Declared first: dropped (stopped) before the index it ticks.
    ticker: Mutex<Option<SnapshotTicker>>,
    inner: Arc<SharedDurable>,
    path: PathBuf,
    durability: String,
}

// Lock discipline (both classes): the RwLock is taken and released entirely inside
// `py.detach`. A thread that held the lock while waiting to get the GIL back would
// deadlock with a thread that holds the GIL while waiting for the lock (seen: the
// gateway's ingest thread applying while its event loop matched).
impl DurableIndex {
    fn with_read<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&CoreDurable) -> T + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let g = self.inner.read().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(f)
        })
        .ok_or_else(closed)
    }

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

    /// Runs a mutation with the GIL released; maps persistence errors.
    fn mutate<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreDurable) -> Result<T, PersistError> + Send,
    ) -> PyResult<T> {
        self.with_write(py, |d| f(d).map_err(|e| (e, d.failure().is_some())))?
            .map_err(|(e, failed)| to_py(e, failed))
    }
}

fn closed() -> PyErr {
    QuillCacheError::new_err("the durable index is closed")
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
        let durability = Durability::parse(durability).map_err(|e| to_py(e, false))?;
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
        let d = py
            .detach(|| CoreDurable::open(&p, opts))
            .map_err(|e| to_py(e, false))?;
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
        let slices: Vec<&[u8]> = payloads.iter().map(|b| b.as_bytes()).collect();
        let source = SourceKey { worker, dp_rank };
        let result = self.with_write(py, |d| {
            d.apply(source, &slices, seqs.as_deref())
                .map_err(|e| (e, d.failure().is_some()))
        })?;
        match result {
            Ok(stats) => Ok(stats_tuple(&stats)),
            Err((ApplyError::Persist(e), failed)) => Err(to_py(e, failed)),
            Err((
                ApplyError::Decode {
                    index,
                    message,
                    applied,
                },
                _,
            )) => Err(decode_error(
                py,
                worker,
                index,
                slices.len(),
                &message,
                &applied,
            )),
        }
    }

    /// `[(worker, dp_rank, medium, blocks), ...]` sorted by (worker, dp_rank, medium).
    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_slice(&keys)?;
        let hits = self.with_read(py, |d| named_hits(d.index(), keys))?;
        match_list(py, &hits)
    }

    fn match_many<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<PyReadonlyArray1<'py, u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in requests {
            out.append(self.match_keys(py, r)?)?;
        }
        Ok(out)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        self.mutate(py, |d| d.remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> PyResult<u64> {
        self.mutate(py, |d| d.clear_source(SourceKey { worker, dp_rank }))
    }

    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let prefix = keys_slice(&prefix)?;
        let entries = self.with_read(py, |d| d.index().scan(prefix))?;
        entries_list(py, &entries)
    }

    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let entries: Vec<EntryOut> = self.with_read(py, |d| d.index().entries().collect())?;
        entries_list(py, &entries)
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
    fn stats(&self, py: Python<'_>) -> PyResult<crate::index::IndexStatsTuple> {
        let s = self.with_read(py, |d| d.index().stats())?;
        Ok((
            s.blocks,
            s.nodes,
            s.resident_pairs,
            s.sources,
            s.pinned,
            s.spilled,
            s.memory_bytes,
            s.media_folded,
        ))
    }

    /// `{(worker, dp_rank): seq}`: the last engine sequence number applied per source.
    fn last_seqs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let seqs: Vec<(SourceKey, u64)> = self.with_read(py, |d| {
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
        let buf = self
            .with_read(py, |d| {
                let mut buf = Vec::new();
                d.index().write_snapshot(&mut buf).map(|_| buf)
            })?
            .map_err(|e| PersistenceError::new_err(e.to_string()))?;
        Ok(PyBytes::new(py, &buf))
    }

    /// What recovery did: snapshot lsn and bytes, records replayed, torn tail, timings.
    fn recovery<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.with_read(py, |d| d.recovery().clone())?;
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
        let (last, synced, snapshot, disk, failure, snapshot_error) = self.with_read(py, |d| {
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
            Some(d) => py.detach(|| d.close()).map_err(|e| to_py(e, false)),
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

// --- KvIndex: the index over a key-value store (memory, rocksdb, holt) -----------

fn kv_err(e: KvIndexError) -> PyErr {
    match e {
        KvIndexError::Decode(m) => EventDecodeError::new_err(m),
        KvIndexError::Store(e) if e.kind == KvErrorKind::Refused => {
            IngestRefusedError::new_err(e.to_string())
        }
        KvIndexError::Store(e) => PersistenceError::new_err(e.to_string()),
        KvIndexError::Corrupt { .. } => CorruptIndexError::new_err(e.to_string()),
    }
}

type BoxedKv = CoreKvIndex<Box<dyn KvStore>>;

/// The residency index kept in a key-value store; same methods as `NativeIndex`.
#[pyclass(frozen, module = "quillcache._native", name = "KvIndex")]
pub struct KvIndex {
    inner: RwLock<Option<BoxedKv>>,
    store: String,
}

impl KvIndex {
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&BoxedKv) -> Result<T, KvIndexError> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let g = self.inner.read().unwrap_or_else(|e| e.into_inner());
            g.as_ref().map(f)
        })
        .ok_or_else(closed)?
        .map_err(kv_err)
    }

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
        .map_err(kv_err)
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
            .map_err(|e| match e {
                KvIndexError::Store(e) if e.store == "backend" => {
                    QuillCacheError::new_err(e.message)
                }
                e => kv_err(e),
            })?;
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
        let slices: Vec<&[u8]> = payloads.iter().map(|b| b.as_bytes()).collect();
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
            Some((i, KvIndexError::Decode(m))) => {
                Err(decode_error(py, worker, i, slices.len(), &m, &total))
            }
            Some((_, e)) => Err(kv_err(e)),
        }
    }

    #[pyo3(name = "match")]
    fn match_keys<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let keys = keys_slice(&keys)?;
        let hits: Vec<Hit> = self
            .with(py, |ix| ix.match_keys(keys))?
            .into_iter()
            // The store keeps the name of a parsed medium: parsing it again is exact.
            .map(|(w, rank, medium, blocks)| (w, rank, Medium::parse(Some(&medium)), blocks))
            .collect();
        match_list(py, &hits)
    }

    fn match_many<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<PyReadonlyArray1<'py, u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for r in requests {
            out.append(self.match_keys(py, r)?)?;
        }
        Ok(out)
    }

    fn remove_worker(&self, py: Python<'_>, worker: u64) -> PyResult<u64> {
        self.with_mut(py, |ix| ix.remove_worker(worker))
    }

    #[pyo3(signature = (worker, dp_rank=0))]
    fn clear_source(&self, py: Python<'_>, worker: u64, dp_rank: u32) -> PyResult<u64> {
        self.with_mut(py, |ix| ix.clear_source(SourceKey { worker, dp_rank }))
    }

    fn scan<'py>(
        &self,
        py: Python<'py>,
        prefix: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let prefix = keys_slice(&prefix)?;
        let entries = self.with(py, |ix| ix.scan(prefix))?;
        entries_list(py, &entries)
    }

    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let entries = self.with(py, |ix| ix.entries())?;
        entries_list(py, &entries)
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
    fn stats(&self, py: Python<'_>) -> PyResult<crate::index::IndexStatsTuple> {
        self.with(py, |ix| {
            let (blocks, nodes, pairs, sources, pinned) = ix.counts()?;
            Ok((
                blocks,
                nodes,
                pairs,
                sources,
                pinned,
                0,
                ix.store().memory_bytes(),
                ix.media_folded(),
            ))
        })
    }

    /// Bytes of the store's files.
    fn disk_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        self.with(py, |ix| Ok(ix.store().disk_bytes()))
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
                r => r.map_err(|e| kv_err(e.into())),
            },
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<KvIndex>()?;
    m.add_class::<DurableIndex>()
}
