//! Snapshot files of the durable index: the index image (`Index::write_snapshot`)
//! wrapped with the log position it covers and the last sequence number per source.
//!
//! ```text
//! version 2 (written):
//! "QCDURSNP" | u32le 2 | u64le lsn | u64le n | n × (u64le worker, u32le dp, u64le seq)
//! | index image | u32le crc32(everything before)
//! version 1 (read): the same with u64le index_len before the index image
//! ```
//!
//! The image is written to the file as it is built (so its length is not known
//! ahead: version 2 has none; the image's own format ends where it ends, and the
//! loader refuses trailing bytes). Written to `snap-<lsn>.tmp`, fsynced, renamed to
//! `snap-<lsn>.qcsnap`, directory fsynced: a snapshot file either is complete and
//! valid or does not exist.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::index::{Index, SourceKey};

use super::error::{io_err, PersistError};
use super::wal::sync_dir;

const MAGIC: &[u8; 8] = b"QCDURSNP";
const VERSION: u32 = 2;
/// The previous version (a length before the index image), still read.
const VERSION_V1: u32 = 1;
/// Bytes written between two requests to the kernel to start writing them back.
const WRITEBACK_EVERY: u64 = 16 << 20;

/// The snapshot file being written: the CRC of every byte, and the kernel asked to
/// start writing back each [`WRITEBACK_EVERY`] bytes as they come, so that the disk
/// works while the rest of the image is built and the final fsync has little left
/// to wait for (`sync_file_range(SYNC_FILE_RANGE_WRITE)` only starts the writeback:
/// the fsync still makes the file durable and reports any error).
struct SnapshotFile {
    file: File,
    crc: crc32fast::Hasher,
    written: u64,
    handed: u64,
}

impl SnapshotFile {
    fn start_writeback(&mut self) {
        #[cfg(target_os = "linux")]
        if self.written - self.handed >= WRITEBACK_EVERY {
            use std::os::fd::AsRawFd;
            // SAFETY: a valid open descriptor and a range of the file; the call only
            // schedules I/O. Its errors show up in the fsync that follows.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.handed as libc::off64_t,
                    (self.written - self.handed) as libc::off64_t,
                    libc::SYNC_FILE_RANGE_WRITE,
                );
            }
            self.handed = self.written;
        }
    }
}

impl Write for SnapshotFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.crc.update(&buf[..n]);
        self.written += n as u64;
        self.start_writeback();
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

pub type LastSeqs = BTreeMap<SourceKey, u64>;

pub fn snapshot_path(dir: &Path, lsn: u64) -> PathBuf {
    dir.join(format!("snap-{lsn:020}.qcsnap"))
}

/// Snapshots in `dir` by lsn, ascending. Leftover `.tmp` files (a crash during a
/// snapshot) are deleted.
pub fn list(dir: &Path) -> Result<Vec<u64>, PersistError> {
    let mut lsns = Vec::new();
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let entry = entry.map_err(io_err(dir))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Some(rest) = name.strip_prefix("snap-") else {
            continue;
        };
        if rest.ends_with(".tmp") {
            let _ = fs::remove_file(entry.path());
        } else if let Some(Ok(lsn)) = rest.strip_suffix(".qcsnap").map(str::parse::<u64>) {
            lsns.push(lsn);
        }
    }
    lsns.sort_unstable();
    Ok(lsns)
}

/// Writes a snapshot atomically; returns its size in bytes.
pub fn write(dir: &Path, lsn: u64, seqs: &LastSeqs, index: &Index) -> Result<u64, PersistError> {
    let mut head = Vec::with_capacity(28 + seqs.len() * 20);
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&lsn.to_le_bytes());
    head.extend_from_slice(&(seqs.len() as u64).to_le_bytes());
    for (src, seq) in seqs {
        head.extend_from_slice(&src.worker.to_le_bytes());
        head.extend_from_slice(&src.dp_rank.to_le_bytes());
        head.extend_from_slice(&seq.to_le_bytes());
    }
    let tmp = dir.join(format!("snap-{lsn:020}.tmp"));
    let result = (|| {
        let file = File::create(&tmp).map_err(io_err(&tmp))?;
        let mut out = SnapshotFile {
            file,
            crc: crc32fast::Hasher::new(),
            written: 0,
            handed: 0,
        };
        out.write_all(&head).map_err(io_err(&tmp))?;
        index.write_snapshot(&mut out).map_err(io_err(&tmp))?;
        let crc = out.crc.clone().finalize();
        out.write_all(&crc.to_le_bytes()).map_err(io_err(&tmp))?;
        out.file.sync_all().map_err(io_err(&tmp))?;
        let path = snapshot_path(dir, lsn);
        fs::rename(&tmp, &path).map_err(io_err(&path))?;
        sync_dir(dir)?;
        Ok(out.written)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// A loaded snapshot.
pub struct Loaded {
    pub lsn: u64,
    pub seqs: LastSeqs,
    pub index: Index,
    pub bytes: u64,
}

pub fn read(dir: &Path, lsn: u64) -> Result<Loaded, PersistError> {
    let path = snapshot_path(dir, lsn);
    let data = fs::read(&path).map_err(io_err(&path))?;
    let corrupt = |reason: String| PersistError::CorruptSnapshot {
        path: path.clone(),
        reason,
    };
    if data.len() < 8 + 4 + 8 + 8 + 4 || &data[..8] != MAGIC {
        return Err(corrupt(
            "not a QuillCache snapshot (bad magic or too short)".into(),
        ));
    }
    let (body, crc) = data.split_at(data.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(corrupt("checksum mismatch (truncated or damaged)".into()));
    }
    let mut at = 8;
    let take = |at: &mut usize, n: usize| -> Result<&[u8], PersistError> {
        let s = body
            .get(*at..at.saturating_add(n))
            .ok_or_else(|| corrupt(format!("truncated at byte {at}")))?;
        *at += n;
        Ok(s)
    };
    let u32le = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    let u64le = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let version = u32le(take(&mut at, 4)?);
    if version != VERSION && version != VERSION_V1 {
        return Err(corrupt(format!(
            "version {version} is not supported (this build reads {VERSION_V1} and {VERSION})"
        )));
    }
    let file_lsn = u64le(take(&mut at, 8)?);
    if file_lsn != lsn {
        return Err(corrupt(format!("names lsn {lsn} but contains {file_lsn}")));
    }
    let n = u64le(take(&mut at, 8)?);
    if n > (body.len() / 20) as u64 {
        return Err(corrupt(format!("impossible source count {n}")));
    }
    let mut seqs = LastSeqs::new();
    for _ in 0..n {
        let worker = u64le(take(&mut at, 8)?);
        let dp_rank = u32le(take(&mut at, 4)?);
        let seq = u64le(take(&mut at, 8)?);
        seqs.insert(SourceKey { worker, dp_rank }, seq);
    }
    let image = if version == VERSION_V1 {
        let len = u64le(take(&mut at, 8)?) as usize;
        take(&mut at, len)?
    } else {
        let rest = &body[at..];
        at = body.len();
        rest
    };
    if at != body.len() {
        return Err(corrupt(format!("{} trailing bytes", body.len() - at)));
    }
    let index = Index::from_snapshot_bytes(image).map_err(|e| corrupt(e.to_string()))?;
    Ok(Loaded {
        lsn,
        seqs,
        index,
        bytes: data.len() as u64,
    })
}
