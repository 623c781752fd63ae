//! Snapshot files of the durable index: the index image (`Index::write_snapshot`)
//! wrapped with the log position it covers and the last sequence number per source.
//!
//! ```text
//! "QCDURSNP" | u32le version | u64le lsn | u64le n | n × (u64le worker, u32le dp, u64le seq)
//! | u64le index_len | index image | u32le crc32(everything before)
//! ```
//!
//! Written to `snap-<lsn>.tmp`, fsynced, renamed to `snap-<lsn>.qcsnap`, directory
//! fsynced: a snapshot file either is complete and valid or does not exist.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::index::{Index, SourceKey};

use super::error::{io_err, PersistError};
use super::wal::sync_dir;

const MAGIC: &[u8; 8] = b"QCDURSNP";
const VERSION: u32 = 1;

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
    let mut buf = Vec::with_capacity(1 << 16);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&lsn.to_le_bytes());
    buf.extend_from_slice(&(seqs.len() as u64).to_le_bytes());
    for (src, seq) in seqs {
        buf.extend_from_slice(&src.worker.to_le_bytes());
        buf.extend_from_slice(&src.dp_rank.to_le_bytes());
        buf.extend_from_slice(&seq.to_le_bytes());
    }
    let len_at = buf.len();
    buf.extend_from_slice(&[0; 8]);
    index.write_snapshot(&mut buf).map_err(io_err(dir))?;
    let index_len = (buf.len() - len_at - 8) as u64;
    buf[len_at..len_at + 8].copy_from_slice(&index_len.to_le_bytes());
    let crc = crc32fast::hash(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());

    let tmp = dir.join(format!("snap-{lsn:020}.tmp"));
    let result = (|| {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&buf).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        let path = snapshot_path(dir, lsn);
        fs::rename(&tmp, &path).map_err(io_err(&path))?;
        sync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| buf.len() as u64)
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
    if data.len() < 8 + 4 + 8 + 8 + 8 + 4 || &data[..8] != MAGIC {
        return Err(corrupt(
            "not a QuillCache snapshot (bad magic or too short)".into(),
        ));
    }
    let (body, crc) = data.split_at(data.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err(corrupt("checksum mismatch (truncated or damaged)".into()));
    }
    let mut at = 8;
    let mut take = |n: usize| -> Result<&[u8], PersistError> {
        let s = body
            .get(at..at + n)
            .ok_or_else(|| corrupt(format!("truncated at byte {at}")))?;
        at += n;
        Ok(s)
    };
    let u32le = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
    let u64le = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let version = u32le(take(4)?);
    if version != VERSION {
        return Err(corrupt(format!(
            "version {version} is not supported (this build reads {VERSION})"
        )));
    }
    let file_lsn = u64le(take(8)?);
    if file_lsn != lsn {
        return Err(corrupt(format!("names lsn {lsn} but contains {file_lsn}")));
    }
    let n = u64le(take(8)?);
    if n > (body.len() / 20) as u64 {
        return Err(corrupt(format!("impossible source count {n}")));
    }
    let mut seqs = LastSeqs::new();
    for _ in 0..n {
        let worker = u64le(take(8)?);
        let dp_rank = u32le(take(4)?);
        let seq = u64le(take(8)?);
        seqs.insert(SourceKey { worker, dp_rank }, seq);
    }
    let index_len = u64le(take(8)?) as usize;
    let image = take(index_len)?;
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
