//! Errors of the persistence layer. Every message names the file and what to do.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    /// The operating system refused a read, write, fsync or rename (disk full,
    /// file too large, read-only or unwritable directory...).
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Damage that is not a torn tail: refusing to guess which state is right.
    #[error(
        "corrupt write-ahead log {path} at byte {offset}: {reason}; \
         restore the directory from a backup or move it away to start empty"
    )]
    CorruptLog {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error(
        "corrupt snapshot {path}: {reason}; \
         move the snapshot away to recover from the write-ahead log alone (if it was not pruned)"
    )]
    CorruptSnapshot { path: PathBuf, reason: String },
    /// An earlier write or fsync failed. The log (and the index built on it) keeps the
    /// state it had before that call and refuses everything after, so that nothing is
    /// acknowledged that is not in the log. Reopen the directory once the cause is fixed.
    #[error(
        "the write-ahead log refuses further writes after an earlier failure ({cause}); \
         the index holds exactly the logged state up to lsn {last_lsn}; fix the cause \
         (e.g. free disk space) and reopen"
    )]
    Failed { cause: String, last_lsn: u64 },
    /// Another process (or another handle in this one) holds the directory.
    #[error("{path} is in use by another QuillCache index (lock file held)")]
    Locked { path: PathBuf },
    /// A logged record that the index could not apply during recovery.
    #[error("cannot replay lsn {lsn} of the write-ahead log: {reason}")]
    Replay { lsn: u64, reason: String },
    #[error("invalid persistence option: {0}")]
    InvalidOption(String),
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> PersistError + '_ {
    move |source| PersistError::Io {
        path: path.to_path_buf(),
        source,
    }
}
