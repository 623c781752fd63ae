//! The crash-safe residency index: [`Index`] + write-ahead log + snapshots.
//!
//! Every mutation is first appended to the log, then applied, so the in-memory index
//! is always exactly "the latest snapshot + the logged records after it". A call whose
//! log write fails changes nothing and the index refuses later mutations
//! ([`PersistError::Failed`]): it never acknowledges state that is not in the log.
//!
//! Recovery = the latest snapshot + the log records after the lsn it covers. The last
//! sequence number applied per source (worker, dp rank) is kept in both, so a
//! connector can ask each engine to replay from `seq + 1`.
//!
//! Directory layout: `LOCK`, `snap-<lsn>.qcsnap` (latest only), `wal/` (segments).

use std::convert::Infallible;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::events::{decode_batch, EventBatch, Medium};
use crate::index::{
    ApplyStats, CompactHits, EntryOut, Index, IndexRead, IndexStats, NamedHit, SourceKey,
};

use super::error::{io_err, PersistError};
use super::frame::{LoggedRecord, Record};
use super::snapshot::{self, LastSeqs};
use super::wal::{lock_dir, Durability, RecoveryReport, Wal, WalOptions};

/// Record kinds in the log (the payload's meaning).
pub mod kind {
    /// A raw msgpack event batch, exactly as the engine sent it.
    pub const BATCH: u8 = 1;
    /// `u32le len ‖ model ‖ u32le len ‖ tokenizer`.
    pub const REGISTER_SOURCE: u8 = 2;
    /// No payload: every source of `worker`.
    pub const REMOVE_WORKER: u8 = 3;
    /// No payload: AllBlocksCleared for (worker, dp rank).
    pub const CLEAR_SOURCE: u8 = 4;
    /// `u64le` keys of the pinned prefix.
    pub const PIN: u8 = 5;
    pub const UNPIN: u8 = 6;
    /// The medium's name (UTF-8): every residency of (worker, dp rank) in it dropped.
    pub const CLEAR_MEDIUM: u8 = 7;
}

/// `seq` of a record that carries none.
pub const NO_SEQ: u64 = u64::MAX;

/// Defaults of the size trigger (measured in docs/persistence.md, "Snapshots").
pub const DEFAULT_SNAPSHOT_MIN_BYTES: u64 = 4 << 20;
pub const DEFAULT_SNAPSHOT_LOG_RATIO: f64 = 0.125;

#[derive(Debug, Clone)]
pub struct DurableOptions {
    pub wal: WalOptions,
    /// The size trigger: take a snapshot once the log written since the last one
    /// exceeds `max(snapshot_every_bytes, snapshot_log_ratio x the last snapshot's
    /// size)` (0 = not by size). The ratio bounds the snapshot bytes written per log
    /// byte to 1/ratio (the idea of Redis's AOF rewrite and of LSM compaction), so a
    /// large index is not rewritten every few MiB of log; the minimum keeps a small
    /// index from snapshotting on every call. docs/persistence.md has the trade-off.
    pub snapshot_every_bytes: u64,
    /// See `snapshot_every_bytes` (0 = a fixed size trigger).
    pub snapshot_log_ratio: f64,
    /// Take a snapshot once this long passed since the last one, if anything was
    /// logged (None = not by time): bounds the tail of a slowly growing log.
    pub snapshot_every: Option<Duration>,
    /// Write periodic snapshots on a background thread: ingest pauses only to clone
    /// the index, not to serialize, write and fsync it.
    pub snapshot_in_background: bool,
    /// Take a snapshot on a clean close (fast reopen, at the cost of a slower close).
    pub snapshot_on_close: bool,
}

impl Default for DurableOptions {
    fn default() -> Self {
        DurableOptions {
            wal: WalOptions::default(),
            snapshot_every_bytes: DEFAULT_SNAPSHOT_MIN_BYTES,
            snapshot_log_ratio: DEFAULT_SNAPSHOT_LOG_RATIO,
            snapshot_every: Some(Duration::from_secs(60)),
            snapshot_in_background: true,
            snapshot_on_close: true,
        }
    }
}

/// A periodic snapshot being written by a background thread.
struct PendingSnapshot {
    lsn: u64,
    /// Returns the snapshot's size in bytes.
    handle: JoinHandle<Result<u64, PersistError>>,
}

/// What recovery did, for logs, metrics and benchmarks.
#[derive(Debug, Clone, Default)]
pub struct RecoveryInfo {
    /// lsn covered by the snapshot loaded (None: recovered from the log alone).
    pub snapshot_lsn: Option<u64>,
    pub snapshot_bytes: u64,
    pub snapshot_load: Duration,
    pub wal: RecoveryReport,
    pub wal_replay: Duration,
    pub total: Duration,
}

/// An apply that stopped at a bad batch: the ones before it were applied (and logged).
#[derive(Debug, thiserror::Error)]
pub enum ApplyError {
    #[error("batch {index} could not be decoded: {message}")]
    Decode {
        index: usize,
        message: String,
        applied: ApplyStats,
    },
    #[error(transparent)]
    Persist(#[from] PersistError),
}

pub struct DurableIndex {
    dir: PathBuf,
    index: Index,
    wal: Wal,
    seqs: LastSeqs,
    opts: DurableOptions,
    snapshot_lsn: u64,
    /// Size of the latest snapshot file (0: none), for the ratio trigger.
    snapshot_bytes: u64,
    /// Log bytes and time since the last snapshot was started (the triggers).
    logged_since_snapshot: u64,
    last_snapshot_at: Instant,
    pending: Option<PendingSnapshot>,
    /// Why the last background snapshot failed (the log still holds everything).
    snapshot_error: Option<String>,
    recovery: RecoveryInfo,
    _lock: fs::File,
}

/// The source a batch applies to: its own dp rank wins (as in `Index::apply_payload`).
fn source_of(source: SourceKey, batch: &EventBatch) -> Result<SourceKey, String> {
    match batch.dp_rank {
        None => Ok(source),
        Some(r) => u32::try_from(r)
            .map(|dp_rank| SourceKey { dp_rank, ..source })
            .map_err(|_| format!("batch dp_rank {r} is not a valid rank (0 ..= 4294967295)")),
    }
}

/// Decodes one payload and resolves the source it applies to.
fn decode_for(source: SourceKey, payload: &[u8]) -> Result<(SourceKey, EventBatch), String> {
    let batch = decode_batch(payload).map_err(|e| e.to_string())?;
    Ok((source_of(source, &batch)?, batch))
}

fn keys_payload(keys: &[u64]) -> Vec<u8> {
    keys.iter().flat_map(|k| k.to_le_bytes()).collect()
}

fn keys_of(payload: &[u8]) -> Vec<u64> {
    payload
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

fn register_payload(model: &str, tokenizer: &str) -> Vec<u8> {
    let mut p = Vec::with_capacity(8 + model.len() + tokenizer.len());
    for s in [model, tokenizer] {
        p.extend_from_slice(&(s.len() as u32).to_le_bytes());
        p.extend_from_slice(s.as_bytes());
    }
    p
}

fn register_of(payload: &[u8]) -> Option<(String, String)> {
    let mut at = 0;
    let mut next = || -> Option<String> {
        let len = u32::from_le_bytes(payload.get(at..at + 4)?.try_into().ok()?) as usize;
        let s = std::str::from_utf8(payload.get(at + 4..at + 4 + len)?).ok()?;
        at += 4 + len;
        Some(s.to_string())
    };
    Some((next()?, next()?))
}

/// Applies one logged record to `index` (recovery). Batches were decoded before they
/// were logged, so a decode failure here means the log was written by another
/// decoder version: an error, not a skip.
fn replay(
    index: &mut Index,
    seqs: &mut LastSeqs,
    rec: LoggedRecord<'_>,
) -> Result<(), PersistError> {
    let r = rec.record;
    let source = SourceKey {
        worker: r.worker,
        dp_rank: r.dp_rank,
    };
    let bad = |reason: String| PersistError::Replay {
        lsn: rec.lsn,
        reason,
    };
    match r.kind {
        kind::BATCH => {
            let (target, batch) = decode_for(source, r.payload).map_err(bad)?;
            index.apply_batch(target, &batch);
            if r.seq != NO_SEQ {
                seqs.insert(source, r.seq);
            }
        }
        kind::REGISTER_SOURCE => {
            let (model, tokenizer) =
                register_of(r.payload).ok_or_else(|| bad("malformed register record".into()))?;
            index.register_source(source, &model, &tokenizer);
        }
        kind::REMOVE_WORKER => {
            index.remove_worker(r.worker);
            seqs.retain(|s, _| s.worker != r.worker);
        }
        kind::CLEAR_SOURCE => {
            index.clear_source(source);
        }
        kind::CLEAR_MEDIUM => {
            let name = std::str::from_utf8(r.payload)
                .map_err(|_| bad("malformed clear-medium record".into()))?;
            index.clear_medium(source, &Medium::parse(Some(name)));
        }
        kind::PIN => index.pin(&keys_of(r.payload)),
        kind::UNPIN => index.unpin(&keys_of(r.payload)),
        other => return Err(bad(format!("unknown record kind {other}"))),
    }
    Ok(())
}

impl DurableIndex {
    /// Opens (creating if needed) the index in `dir` and recovers its state.
    pub fn open(dir: &Path, opts: DurableOptions) -> Result<DurableIndex, PersistError> {
        let started = Instant::now();
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock = lock_dir(dir)?;
        let mut recovery = RecoveryInfo::default();
        let snaps = snapshot::list(dir)?;
        let (mut index, mut seqs, snapshot_lsn) = match snaps.last() {
            Some(&lsn) => {
                let t = Instant::now();
                let loaded = snapshot::read(dir, lsn)?;
                recovery.snapshot_load = t.elapsed();
                recovery.snapshot_lsn = Some(lsn);
                recovery.snapshot_bytes = loaded.bytes;
                (loaded.index, loaded.seqs, lsn)
            }
            None => (Index::new(), LastSeqs::new(), 0),
        };
        let t = Instant::now();
        let (wal, report) = Wal::open(
            &dir.join("wal"),
            opts.wal.clone(),
            snapshot_lsn + 1,
            |rec| replay(&mut index, &mut seqs, rec),
        )?;
        recovery.wal_replay = t.elapsed();
        let logged_since_snapshot = report.bytes_read;
        recovery.wal = report;
        recovery.total = started.elapsed();
        // Older snapshots left by a crash between rename and cleanup.
        for &old in &snaps[..snaps.len().saturating_sub(1)] {
            let _ = fs::remove_file(snapshot::snapshot_path(dir, old));
        }
        Ok(DurableIndex {
            dir: dir.to_path_buf(),
            index,
            wal,
            seqs,
            opts,
            snapshot_lsn,
            snapshot_bytes: recovery.snapshot_bytes,
            logged_since_snapshot,
            last_snapshot_at: Instant::now(),
            pending: None,
            snapshot_error: None,
            recovery,
            _lock: lock,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn durability(&self) -> Durability {
        self.wal.durability()
    }

    /// The index (read-only: every mutation goes through the log).
    pub fn index(&self) -> &Index {
        &self.index
    }

    pub fn recovery(&self) -> &RecoveryInfo {
        &self.recovery
    }

    /// The last sequence number applied per source (as given to `apply`).
    pub fn last_seqs(&self) -> &LastSeqs {
        &self.seqs
    }

    pub fn last_lsn(&self) -> u64 {
        self.wal.last_lsn()
    }

    pub fn synced_lsn(&self) -> u64 {
        self.wal.synced_lsn()
    }

    pub fn snapshot_lsn(&self) -> u64 {
        self.snapshot_lsn
    }

    /// Why the last background snapshot failed, if it did (ingest goes on: the log
    /// still holds every record; the next trigger tries again).
    pub fn snapshot_error(&self) -> Option<&str> {
        self.snapshot_error.as_deref()
    }

    /// `Some(cause)` once a write failed and the index refuses mutations.
    pub fn failure(&self) -> Option<String> {
        self.wal.failure()
    }

    /// Bytes of the snapshot and log files.
    pub fn disk_bytes(&self) -> u64 {
        let snap = fs::metadata(snapshot::snapshot_path(&self.dir, self.snapshot_lsn))
            .map(|m| m.len())
            .unwrap_or(0);
        snap + self.wal.disk_bytes()
    }

    /// Decodes `payloads` (raw msgpack batches from `source`, in order), logs the
    /// decodable prefix with one write, then applies it. `seqs`, if given, holds the
    /// engine's sequence number of each batch. A batch that fails to decode stops the
    /// call: the ones before it are applied, it and the ones after are not.
    pub fn apply(
        &mut self,
        source: SourceKey,
        payloads: &[&[u8]],
        seqs: Option<&[u64]>,
    ) -> Result<ApplyStats, ApplyError> {
        if let Some(s) = seqs {
            if s.len() != payloads.len() {
                return Err(PersistError::InvalidOption(format!(
                    "{} sequence numbers for {} batches",
                    s.len(),
                    payloads.len()
                ))
                .into());
            }
        }
        let mut batches = Vec::with_capacity(payloads.len());
        let mut failed = None;
        for (i, p) in payloads.iter().enumerate() {
            match decode_for(source, p) {
                Ok(tb) => batches.push(tb),
                Err(e) => {
                    failed = Some((i, e));
                    break;
                }
            }
        }
        let mut records = Vec::with_capacity(batches.len());
        for (i, _) in batches.iter().enumerate() {
            let seq = seqs.map_or(NO_SEQ, |s| s[i]);
            records.push(Record {
                kind: kind::BATCH,
                worker: source.worker,
                dp_rank: source.dp_rank,
                seq,
                payload: payloads[i],
            });
        }
        self.log(&records)?;
        let mut stats = ApplyStats::default();
        for (target, batch) in &batches {
            stats += self.index.apply_batch(*target, batch);
        }
        if let Some(last) = records.iter().rev().find(|r| r.seq != NO_SEQ) {
            self.seqs.insert(source, last.seq);
        }
        self.maybe_snapshot()?;
        match failed {
            Some((index, message)) => Err(ApplyError::Decode {
                index,
                message,
                applied: stats,
            }),
            None => Ok(stats),
        }
    }

    fn log(&mut self, records: &[Record<'_>]) -> Result<(), PersistError> {
        if records.is_empty() {
            return Ok(());
        }
        self.wal.append(records)?;
        self.logged_since_snapshot += records
            .iter()
            .map(|r| super::frame::frame_len(r.payload.len()) as u64)
            .sum::<u64>();
        Ok(())
    }

    fn log_one(&mut self, kind: u8, source: SourceKey, payload: &[u8]) -> Result<(), PersistError> {
        self.log(&[Record {
            kind,
            worker: source.worker,
            dp_rank: source.dp_rank,
            seq: NO_SEQ,
            payload,
        }])
    }

    pub fn register_source(
        &mut self,
        source: SourceKey,
        model: &str,
        tokenizer: &str,
    ) -> Result<(), PersistError> {
        self.log_one(
            kind::REGISTER_SOURCE,
            source,
            &register_payload(model, tokenizer),
        )?;
        self.index.register_source(source, model, tokenizer);
        Ok(())
    }

    pub fn remove_worker(&mut self, worker: u64) -> Result<u64, PersistError> {
        self.log_one(kind::REMOVE_WORKER, SourceKey { worker, dp_rank: 0 }, &[])?;
        self.seqs.retain(|s, _| s.worker != worker);
        Ok(self.index.remove_worker(worker))
    }

    pub fn clear_source(&mut self, source: SourceKey) -> Result<u64, PersistError> {
        self.log_one(kind::CLEAR_SOURCE, source, &[])?;
        Ok(self.index.clear_source(source))
    }

    pub fn clear_medium(
        &mut self,
        source: SourceKey,
        medium: &Medium,
    ) -> Result<u64, PersistError> {
        self.log_one(kind::CLEAR_MEDIUM, source, medium.as_str().as_bytes())?;
        Ok(self.index.clear_medium(source, medium))
    }

    pub fn pin(&mut self, keys: &[u64]) -> Result<(), PersistError> {
        self.log_one(
            kind::PIN,
            SourceKey {
                worker: 0,
                dp_rank: 0,
            },
            &keys_payload(keys),
        )?;
        self.index.pin(keys);
        Ok(())
    }

    pub fn unpin(&mut self, keys: &[u64]) -> Result<(), PersistError> {
        self.log_one(
            kind::UNPIN,
            SourceKey {
                worker: 0,
                dp_rank: 0,
            },
            &keys_payload(keys),
        )?;
        self.index.unpin(keys);
        Ok(())
    }

    /// Log bytes since the last snapshot that trigger the next one (0 = never by
    /// size): `max(snapshot_every_bytes, snapshot_log_ratio x last snapshot size)`.
    pub fn snapshot_trigger_bytes(&self) -> u64 {
        let by_ratio = (self.opts.snapshot_log_ratio.max(0.0) * self.snapshot_bytes as f64) as u64;
        self.opts.snapshot_every_bytes.max(by_ratio)
    }

    /// The periodic snapshot, checked after each logged call (a group-commit
    /// boundary) and by [`DurableIndex::tick`]: by log bytes or by time since the
    /// last one.
    fn maybe_snapshot(&mut self) -> Result<(), PersistError> {
        let every = self.snapshot_trigger_bytes();
        // Backpressure: a snapshot slower than ingest must not let the log (the
        // replay after a crash) grow without bound behind it.
        let overdue = every > 0 && self.logged_since_snapshot >= every.saturating_mul(2);
        self.reap_snapshot(overdue)?;
        if self.pending.is_some() || self.logged_since_snapshot == 0 {
            return Ok(());
        }
        let due = (every > 0 && self.logged_since_snapshot >= every)
            || self
                .opts
                .snapshot_every
                .is_some_and(|d| self.last_snapshot_at.elapsed() >= d);
        if !due {
            return Ok(());
        }
        if self.opts.snapshot_in_background {
            self.start_background_snapshot()
        } else {
            self.snapshot().map(|_| ())
        }
    }

    /// Housekeeping while ingest may be idle, called by a timer
    /// ([`super::ticker::SnapshotTicker`]) under the same lock as every mutation:
    /// adopts a finished background snapshot (pruning the log it covers) and takes
    /// the time-triggered snapshot that `apply` would take if it were called. Does
    /// nothing once the log failed. An error is kept in `snapshot_error`.
    pub fn tick(&mut self) {
        if self.wal.failure().is_some() {
            return;
        }
        if let Err(e) = self.maybe_snapshot() {
            self.snapshot_error = Some(e.to_string());
        }
    }

    /// How often a timer should call [`DurableIndex::tick`]: often enough that the
    /// time trigger is late by at most ~1/4 of its period (at most 1 s late).
    pub fn tick_period(&self) -> Duration {
        let period = self.opts.snapshot_every.unwrap_or(Duration::from_secs(4)) / 4;
        period.clamp(Duration::from_millis(1), Duration::from_secs(1))
    }

    /// Rotates the log and hands a clone of the index to a thread that writes it.
    fn start_background_snapshot(&mut self) -> Result<(), PersistError> {
        let lsn = self.wal.last_lsn();
        self.logged_since_snapshot = 0;
        self.last_snapshot_at = Instant::now();
        if lsn == self.snapshot_lsn {
            return Ok(());
        }
        self.wal.rotate()?;
        let (dir, seqs, index) = (self.dir.clone(), self.seqs.clone(), self.index.clone());
        let handle = std::thread::Builder::new()
            .name("quillcache-snapshot".into())
            .spawn(move || snapshot::write(&dir, lsn, &seqs, &index))
            .map_err(io_err(&self.dir))?;
        self.pending = Some(PendingSnapshot { lsn, handle });
        Ok(())
    }

    /// Collects a finished background snapshot (or waits for it): on success it
    /// becomes the snapshot and the log it covers is deleted; a failure is kept in
    /// `snapshot_error` and costs nothing else (the log still has every record).
    fn reap_snapshot(&mut self, wait: bool) -> Result<(), PersistError> {
        match &self.pending {
            Some(p) if wait || p.handle.is_finished() => {}
            _ => return Ok(()),
        }
        let PendingSnapshot { lsn, handle } = self.pending.take().expect("checked");
        match handle.join() {
            Ok(Ok(bytes)) => {
                self.snapshot_error = None;
                self.adopt_snapshot(lsn, bytes)
            }
            Ok(Err(e)) => {
                self.snapshot_error = Some(e.to_string());
                Ok(())
            }
            Err(_) => {
                self.snapshot_error = Some("the snapshot thread panicked".into());
                Ok(())
            }
        }
    }

    /// `lsn`'s snapshot file is complete: make it current, drop the older one and
    /// the log segments it covers.
    fn adopt_snapshot(&mut self, lsn: u64, bytes: u64) -> Result<(), PersistError> {
        let old = self.snapshot_lsn;
        self.snapshot_lsn = lsn;
        self.snapshot_bytes = bytes;
        if old != lsn {
            let _ = fs::remove_file(snapshot::snapshot_path(&self.dir, old));
        }
        self.wal.prune_through(lsn)?;
        Ok(())
    }

    /// fsyncs the log now (whatever the durability); returns the lsn now durable.
    pub fn sync(&mut self) -> Result<u64, PersistError> {
        self.wal.sync()
    }

    /// Writes a snapshot covering every record so far, then deletes the older
    /// snapshot and the log segments it covers. Returns the lsn covered.
    pub fn snapshot(&mut self) -> Result<u64, PersistError> {
        self.reap_snapshot(true)?;
        if let Some(cause) = self.wal.failure() {
            return Err(PersistError::Failed {
                cause,
                last_lsn: self.wal.last_lsn(),
            });
        }
        let lsn = self.wal.last_lsn();
        if lsn == self.snapshot_lsn && lsn > 0 {
            return Ok(lsn);
        }
        self.wal.rotate()?;
        let bytes = snapshot::write(&self.dir, lsn, &self.seqs, &self.index)?;
        self.logged_since_snapshot = 0;
        self.last_snapshot_at = Instant::now();
        self.adopt_snapshot(lsn, bytes)?;
        Ok(lsn)
    }

    /// Snapshot (if configured and anything changed) and fsync. Consumes the index.
    pub fn close(mut self) -> Result<(), PersistError> {
        self.reap_snapshot(true)?;
        if self.wal.failure().is_none() {
            if self.opts.snapshot_on_close && self.wal.last_lsn() != self.snapshot_lsn {
                self.snapshot()?;
            }
            if self.durability() != Durability::None {
                self.wal.sync()?;
            }
        }
        Ok(())
    }
}

/// The reads of the index it keeps: a durable index answers from memory alone.
impl IndexRead for DurableIndex {
    type Error = Infallible;

    fn matches(&self, keys: &[u64]) -> Result<Vec<NamedHit>, Infallible> {
        self.index.matches(keys)
    }

    fn matches_compact(&self, keys: &[u64]) -> Result<CompactHits, Infallible> {
        self.index.matches_compact(keys)
    }

    fn floor_holders(&self, f: &mut dyn FnMut(u64, u32)) {
        self.index.floor_holders(f);
    }

    fn scan(&self, prefix: &[u64]) -> Result<Vec<EntryOut>, Infallible> {
        IndexRead::scan(&self.index, prefix)
    }

    fn entries(&self) -> Result<Vec<EntryOut>, Infallible> {
        IndexRead::entries(&self.index)
    }

    fn stats(&self) -> Result<IndexStats, Infallible> {
        IndexRead::stats(&self.index)
    }
}

impl Drop for DurableIndex {
    /// A background snapshot must not outlive the directory lock (another process
    /// could open the directory while it writes there).
    fn drop(&mut self) {
        if let Some(p) = self.pending.take() {
            let _ = p.handle.join();
        }
    }
}
