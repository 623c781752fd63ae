//! The write-ahead log: an ordered sequence of records (applied event batches and the
//! other mutations of an index), split over segment files, each record in a
//! checksummed frame (see [`frame`](super::frame)).
//!
//! * **Group commit.** [`Wal::append`] writes any number of records with one `write(2)`
//!   and at most one `fsync`; with [`Durability::Interval`] a background thread fsyncs
//!   everything written so far at most every N ms, off the ingest path.
//! * **Acknowledgement.** When `append` returns, the records are in the kernel (they
//!   survive a crash of the process). They survive a crash of the machine once fsynced:
//!   at once with [`Durability::PerBatch`], within N ms with `Interval`, whenever the
//!   kernel writes back with [`Durability::None`]. [`Wal::synced_lsn`] tells how far.
//! * **Recovery** reads frames until the first bad one. A bad frame at the end of the
//!   last segment is a torn tail (a write cut short by a crash): it is truncated and
//!   reported. A bad frame followed by a valid one, a bad frame in an earlier segment, or
//!   a gap in the record numbers is corruption: [`PersistError::CorruptLog`], never a
//!   silent skip.
//! * **Failure.** After a failed write or fsync (disk full, file too large...) the log
//!   refuses every later append ([`PersistError::Failed`]): a caller that applies only
//!   what was appended stays consistent with the log instead of acknowledging lost data.
//!
//! Files: `<dir>/<base lsn, 20 digits>.wal`, each starting with `QCWAL001` + u64le base
//! lsn, and `<dir>/LOCK` (an advisory lock: one writer per directory).

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::error::{io_err, PersistError};
use super::frame::{self, LoggedRecord, Record};

const MAGIC: &[u8; 8] = b"QCWAL001";
const SEGMENT_HEADER: usize = 16;

/// When appended records are fsynced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Never fsync the log (the kernel writes back when it likes). Survives process
    /// crashes, not power loss.
    None,
    /// fsync before `append` returns: nothing acknowledged is ever lost.
    PerBatch,
    /// fsync in the background at most every this many milliseconds: at most that
    /// window is lost on power loss, at almost no ingest cost. The default (10 ms).
    Interval(Duration),
}

impl Default for Durability {
    fn default() -> Self {
        Durability::Interval(Duration::from_millis(10))
    }
}

impl Durability {
    /// Parses `none`, `per-batch` (or `batch`), `interval` (the 10 ms default) or
    /// `interval:<ms>` / `<ms>ms`.
    pub fn parse(s: &str) -> Result<Durability, PersistError> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || {
            PersistError::InvalidOption(format!(
                "durability {s:?}: expected none, per-batch, interval or interval:<ms>"
            ))
        };
        match t.as_str() {
            "none" | "off" => Ok(Durability::None),
            "per-batch" | "per_batch" | "perbatch" | "batch" => Ok(Durability::PerBatch),
            "interval" | "default" => Ok(Durability::default()),
            _ => {
                let ms = t
                    .strip_prefix("interval:")
                    .or_else(|| t.strip_suffix("ms"))
                    .ok_or_else(bad)?;
                let ms: u64 = ms.trim().parse().map_err(|_| bad())?;
                if ms == 0 {
                    return Ok(Durability::PerBatch);
                }
                Ok(Durability::Interval(Duration::from_millis(ms)))
            }
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Durability::None => "none".into(),
            Durability::PerBatch => "per-batch".into(),
            Durability::Interval(d) => format!("interval:{}", d.as_millis()),
        }
    }
}

#[derive(Debug, Clone)]
pub struct WalOptions {
    pub durability: Durability,
    /// A new segment starts once the current one exceeds this size.
    pub segment_bytes: u64,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            durability: Durability::default(),
            segment_bytes: 64 << 20,
        }
    }
}

/// A torn tail that recovery cut off.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TornTail {
    pub path: PathBuf,
    /// Where the last valid frame ended (the new length of the file).
    pub offset: u64,
    pub bytes_dropped: u64,
    pub reason: &'static str,
}

/// What opening the log found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub segments: usize,
    pub records_read: u64,
    /// Records handed to the callback (those at or after `from_lsn`).
    pub records_replayed: u64,
    pub bytes_read: u64,
    /// The lsn of the last valid record (0 for an empty log).
    pub last_lsn: u64,
    pub torn_tail: Option<TornTail>,
}

/// State shared with the background fsync thread.
struct Shared {
    file: Mutex<Arc<File>>,
    written_lsn: AtomicU64,
    synced_lsn: AtomicU64,
    error: Mutex<Option<String>>,
    stop: Mutex<bool>,
    wake: Condvar,
}

impl Shared {
    /// fsyncs everything written so far. The lsn is read before the file so that a
    /// concurrent rotation (which fsyncs the old segment itself) cannot be missed.
    fn sync_now(&self) -> Result<u64, String> {
        let written = self.written_lsn.load(Ordering::Acquire);
        if written <= self.synced_lsn.load(Ordering::Acquire) {
            return Ok(written);
        }
        let file = self.file.lock().expect("wal file lock").clone();
        file.sync_data().map_err(|e| format!("fsync failed: {e}"))?;
        self.synced_lsn.fetch_max(written, Ordering::AcqRel);
        Ok(written)
    }

    fn fail(&self, cause: String) {
        let mut e = self.error.lock().expect("wal error lock");
        if e.is_none() {
            *e = Some(cause);
        }
    }
}

pub struct Wal {
    dir: PathBuf,
    opts: WalOptions,
    /// Base lsns of the segments on disk, ascending; the last one is being appended.
    segments: Vec<u64>,
    file: Arc<File>,
    file_len: u64,
    next_lsn: u64,
    buf: Vec<u8>,
    shared: Arc<Shared>,
    flusher: Option<JoinHandle<()>>,
    _lock: File,
}

fn segment_path(dir: &Path, base: u64) -> PathBuf {
    dir.join(format!("{base:020}.wal"))
}

fn list_segments(dir: &Path) -> Result<Vec<u64>, PersistError> {
    let mut bases = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(stem) = name.strip_suffix(".wal") {
            if let Ok(base) = stem.parse::<u64>() {
                bases.push(base);
            }
        }
    }
    bases.sort_unstable();
    Ok(bases)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<(), PersistError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(dir))
}

/// Takes the advisory lock on `<dir>/LOCK` (released by the OS if the process dies).
// `File::try_lock` is Rust 1.89; the rocksdb feature needs 1.88 anyway (see the report
// to the lead about raising the workspace's rust-version).
#[allow(clippy::incompatible_msrv)]
pub(crate) fn lock_dir(dir: &Path) -> Result<File, PersistError> {
    let path = dir.join("LOCK");
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(PersistError::Locked {
            path: dir.to_path_buf(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_err(&path)(e)),
    }
}

fn create_segment(dir: &Path, base: u64, durable: bool) -> Result<File, PersistError> {
    let path = segment_path(dir, base);
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .map_err(io_err(&path))?;
    let mut header = [0u8; SEGMENT_HEADER];
    header[..8].copy_from_slice(MAGIC);
    header[8..].copy_from_slice(&base.to_le_bytes());
    f.write_all(&header).map_err(io_err(&path))?;
    if durable {
        f.sync_data().map_err(io_err(&path))?;
        sync_dir(dir)?;
    }
    Ok(f)
}

impl Wal {
    /// Opens (or creates) the log in `dir`, hands every valid record with
    /// `lsn >= from_lsn` to `replay` in order, truncates a torn tail, and returns the
    /// log ready for appending after the last valid record.
    ///
    /// `from_lsn` is one past what a snapshot covers (1 without a snapshot). Records
    /// before it are checked but not replayed; a log that starts after it (records
    /// missing) is corruption.
    pub fn open(
        dir: &Path,
        opts: WalOptions,
        from_lsn: u64,
        mut replay: impl FnMut(LoggedRecord<'_>) -> Result<(), PersistError>,
    ) -> Result<(Wal, RecoveryReport), PersistError> {
        if opts.segment_bytes < SEGMENT_HEADER as u64 {
            return Err(PersistError::InvalidOption(format!(
                "segment_bytes {} is too small",
                opts.segment_bytes
            )));
        }
        let from_lsn = from_lsn.max(1);
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let lock = lock_dir(dir)?;
        let mut segments = list_segments(dir)?;
        let mut report = RecoveryReport {
            segments: segments.len(),
            ..Default::default()
        };
        let durable = opts.durability != Durability::None;

        if let Some(&first) = segments.first() {
            if first > from_lsn {
                return Err(PersistError::CorruptLog {
                    path: segment_path(dir, first),
                    offset: 0,
                    reason: format!(
                        "records {from_lsn}..{first} are missing (the log starts at {first})"
                    ),
                });
            }
        }

        let mut expected = segments.first().copied().unwrap_or(from_lsn);
        let mut tail_len = 0u64; // valid length of the last segment
        for (i, &base) in segments.iter().enumerate() {
            let path = segment_path(dir, base);
            let is_last = i + 1 == segments.len();
            let data = fs::read(&path).map_err(io_err(&path))?;
            report.bytes_read += data.len() as u64;
            let corrupt = |offset: usize, reason: String| PersistError::CorruptLog {
                path: path.clone(),
                offset: offset as u64,
                reason,
            };
            if base != expected {
                return Err(corrupt(
                    0,
                    format!("segment starts at lsn {base} but lsn {expected} was expected"),
                ));
            }
            if data.len() < SEGMENT_HEADER {
                if is_last {
                    // Created just before a crash: rewrite the header below.
                    report.torn_tail = Some(TornTail {
                        path: path.clone(),
                        offset: 0,
                        bytes_dropped: data.len() as u64,
                        reason: "incomplete segment header",
                    });
                    tail_len = 0;
                    continue;
                }
                return Err(corrupt(0, "segment header is incomplete".into()));
            }
            if &data[..8] != MAGIC || data[8..16] != base.to_le_bytes() {
                return Err(corrupt(
                    0,
                    "bad segment header (not a QuillCache log?)".into(),
                ));
            }
            let mut at = SEGMENT_HEADER;
            while at < data.len() {
                match frame::decode(&data, at) {
                    Ok((rec, next)) => {
                        if rec.lsn != expected {
                            return Err(corrupt(
                                at,
                                format!("record has lsn {} where {expected} was expected", rec.lsn),
                            ));
                        }
                        report.records_read += 1;
                        if rec.lsn >= from_lsn {
                            replay(rec)?;
                            report.records_replayed += 1;
                        }
                        expected += 1;
                        at = next;
                    }
                    Err(bad) => {
                        if let Some((valid_at, lsn)) = frame::find_valid_after(&data, at, expected)
                        {
                            return Err(corrupt(
                                at,
                                format!(
                                    "{} followed by a valid record (lsn {lsn} at byte {valid_at}): \
                                     damage in the middle of the log, not a torn tail",
                                    bad.describe()
                                ),
                            ));
                        }
                        if !is_last {
                            return Err(corrupt(
                                at,
                                format!("{} in a segment that is not the last", bad.describe()),
                            ));
                        }
                        report.torn_tail = Some(TornTail {
                            path: path.clone(),
                            offset: at as u64,
                            bytes_dropped: (data.len() - at) as u64,
                            reason: bad.describe(),
                        });
                        break;
                    }
                }
            }
            tail_len = at.min(data.len()) as u64;
        }
        report.last_lsn = expected - 1;

        // The file to append to: the last segment (cut to its valid length), or a new
        // one if there is none, its header is torn, or it ends before `from_lsn`.
        let append_to_last =
            segments.last().is_some() && tail_len >= SEGMENT_HEADER as u64 && expected >= from_lsn;
        let file = if append_to_last {
            let path = segment_path(dir, *segments.last().expect("a segment"));
            let mut f = OpenOptions::new()
                .write(true)
                .open(&path)
                .map_err(io_err(&path))?;
            if report.torn_tail.is_some() {
                f.set_len(tail_len).map_err(io_err(&path))?;
                f.sync_all().map_err(io_err(&path))?;
            }
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(tail_len))
                .map_err(io_err(&path))?;
            f
        } else {
            if expected < from_lsn {
                // The snapshot covers every logged record (and more: an unsynced tail
                // was lost with the machine, or everything was pruned): start afresh.
                for base in segments.drain(..) {
                    let path = segment_path(dir, base);
                    fs::remove_file(&path).map_err(io_err(&path))?;
                }
                expected = from_lsn;
            } else if segments.last().is_some() {
                segments.pop(); // its header was torn: recreate it in place
            }
            tail_len = SEGMENT_HEADER as u64;
            let f = create_segment(dir, expected, true)?;
            segments.push(expected);
            f
        };
        let file = Arc::new(file);
        let last = expected - 1;
        let shared = Arc::new(Shared {
            file: Mutex::new(file.clone()),
            written_lsn: AtomicU64::new(last),
            synced_lsn: AtomicU64::new(if durable { last } else { 0 }),
            error: Mutex::new(None),
            stop: Mutex::new(false),
            wake: Condvar::new(),
        });
        let flusher = match opts.durability {
            Durability::Interval(every) => {
                let shared = shared.clone();
                Some(
                    std::thread::Builder::new()
                        .name("quillcache-wal-fsync".into())
                        .spawn(move || flusher_loop(&shared, every))
                        .map_err(io_err(dir))?,
                )
            }
            _ => None,
        };
        Ok((
            Wal {
                dir: dir.to_path_buf(),
                opts,
                segments,
                file,
                file_len: tail_len,
                next_lsn: expected,
                buf: Vec::new(),
                shared,
                flusher,
                _lock: lock,
            },
            report,
        ))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn durability(&self) -> Durability {
        self.opts.durability
    }

    /// The lsn of the last appended record (0 if none ever).
    pub fn last_lsn(&self) -> u64 {
        self.next_lsn - 1
    }

    /// Every record up to this lsn has been fsynced.
    pub fn synced_lsn(&self) -> u64 {
        self.shared.synced_lsn.load(Ordering::Acquire)
    }

    /// Bytes currently in the log's segment files.
    pub fn disk_bytes(&self) -> u64 {
        self.segments
            .iter()
            .filter_map(|&b| fs::metadata(segment_path(&self.dir, b)).ok())
            .map(|m| m.len())
            .sum()
    }

    /// `Some(cause)` once the log has failed and refuses writes.
    pub fn failure(&self) -> Option<String> {
        self.shared.error.lock().expect("wal error lock").clone()
    }

    fn check_failed(&self) -> Result<(), PersistError> {
        match self.failure() {
            Some(cause) => Err(PersistError::Failed {
                cause,
                last_lsn: self.last_lsn(),
            }),
            None => Ok(()),
        }
    }

    fn fail(&self, e: PersistError) -> PersistError {
        self.shared.fail(e.to_string());
        e
    }

    /// Appends `records` with one write (and, with `PerBatch`, one fsync). Returns the
    /// lsn of the last one. On error nothing of this call counts as appended, and the
    /// log refuses every later call.
    pub fn append(&mut self, records: &[Record<'_>]) -> Result<u64, PersistError> {
        self.check_failed()?;
        if records.is_empty() {
            return Ok(self.last_lsn());
        }
        if self.file_len >= self.opts.segment_bytes {
            self.rotate().map_err(|e| self.fail(e))?;
        }
        self.buf.clear();
        let mut lsn = self.next_lsn;
        for r in records {
            if frame::RECORD_HEADER + r.payload.len() > frame::MAX_BODY {
                return Err(PersistError::InvalidOption(format!(
                    "a record of {} bytes exceeds the log's limit of {} bytes",
                    r.payload.len(),
                    frame::MAX_BODY
                )));
            }
            frame::encode(&mut self.buf, lsn, r);
            lsn += 1;
        }
        let path = segment_path(&self.dir, *self.segments.last().expect("a segment"));
        if let Err(e) = (&*self.file).write_all(&self.buf) {
            // Cut a partial write off so that no unacknowledged frame survives a restart.
            let _ = self.file.set_len(self.file_len);
            let _ = std::io::Seek::seek(&mut &*self.file, std::io::SeekFrom::Start(self.file_len));
            return Err(self.fail(io_err(&path)(e)));
        }
        self.file_len += self.buf.len() as u64;
        self.next_lsn = lsn;
        let last = lsn - 1;
        self.shared.written_lsn.store(last, Ordering::Release);
        if self.opts.durability == Durability::PerBatch {
            self.file
                .sync_data()
                .map_err(|e| self.fail(io_err(&path)(e)))?;
            self.shared.synced_lsn.fetch_max(last, Ordering::AcqRel);
        }
        Ok(last)
    }

    /// fsyncs everything appended so far, whatever the durability setting.
    pub fn sync(&mut self) -> Result<u64, PersistError> {
        self.check_failed()?;
        self.shared.sync_now().map_err(|cause| {
            self.shared.fail(cause.clone());
            PersistError::Failed {
                cause,
                last_lsn: self.last_lsn(),
            }
        })
    }

    /// Starts a new segment at the next lsn (the old one is fsynced first unless the
    /// durability is `None`). Used on size overflow and before a snapshot, so that the
    /// segments a snapshot covers can be deleted whole.
    pub fn rotate(&mut self) -> Result<(), PersistError> {
        self.check_failed()?;
        if self.file_len <= SEGMENT_HEADER as u64 {
            return Ok(()); // already empty
        }
        let durable = self.opts.durability != Durability::None;
        if durable {
            let path = segment_path(&self.dir, *self.segments.last().expect("a segment"));
            self.file
                .sync_data()
                .map_err(|e| self.fail(io_err(&path)(e)))?;
            self.shared
                .synced_lsn
                .fetch_max(self.last_lsn(), Ordering::AcqRel);
        }
        let base = self.next_lsn;
        let file = match create_segment(&self.dir, base, durable) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                // A half-created segment must not stay behind the records still to come
                // in the current one (recovery would see a gap): remove it, and stop
                // accepting writes so that nothing lands after it if removal failed too.
                let _ = fs::remove_file(segment_path(&self.dir, base));
                return Err(self.fail(e));
            }
        };
        *self.shared.file.lock().expect("wal file lock") = file.clone();
        self.file = file;
        self.file_len = SEGMENT_HEADER as u64;
        self.segments.push(base);
        Ok(())
    }

    /// Deletes the segments whose records all have `lsn <= upto` (never the current
    /// one). Returns how many were deleted.
    pub fn prune_through(&mut self, upto: u64) -> Result<usize, PersistError> {
        let mut removed = 0;
        while self.segments.len() > 1 && self.segments[1] <= upto + 1 {
            let path = segment_path(&self.dir, self.segments[0]);
            fs::remove_file(&path).map_err(io_err(&path))?;
            self.segments.remove(0);
            removed += 1;
        }
        if removed > 0 {
            sync_dir(&self.dir)?;
        }
        Ok(removed)
    }

    /// Stops the fsync thread and, unless the durability is `None`, fsyncs the tail.
    pub fn close(mut self) -> Result<(), PersistError> {
        self.stop_flusher();
        if self.opts.durability != Durability::None && self.failure().is_none() {
            self.sync()?;
        }
        Ok(())
    }

    fn stop_flusher(&mut self) {
        if let Some(handle) = self.flusher.take() {
            *self.shared.stop.lock().expect("wal stop lock") = true;
            self.shared.wake.notify_all();
            let _ = handle.join();
        }
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        self.stop_flusher();
    }
}

fn flusher_loop(shared: &Shared, every: Duration) {
    let mut stop = shared.stop.lock().expect("wal stop lock");
    loop {
        let (guard, _) = shared
            .wake
            .wait_timeout(stop, every)
            .expect("wal stop lock");
        stop = guard;
        if *stop {
            return;
        }
        drop(stop);
        if shared.error.lock().expect("wal error lock").is_none() {
            if let Err(cause) = shared.sync_now() {
                shared.fail(cause);
            }
        }
        stop = shared.stop.lock().expect("wal stop lock");
    }
}
