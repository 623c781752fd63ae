//! The exception hierarchy of `quillcache._native` (re-exported by `quillcache.errors`),
//! and the one mapping of `quillcache-core`'s errors onto it ([`CoreError`]).

use std::convert::Infallible;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyValueError};
use pyo3::prelude::*;

use quillcache_core::backends::kv_index::KvIndexError;
use quillcache_core::backends::{KvError, KvErrorKind};
use quillcache_core::events::DecodeError;
use quillcache_core::index::{ApplyStats, ReserveError, SnapshotError};
use quillcache_core::persist::PersistError;

use crate::convert::stats_tuple;

create_exception!(
    quillcache._native,
    QuillCacheError,
    PyException,
    "Base class of every QuillCache error."
);
create_exception!(
    quillcache._native,
    EventDecodeError,
    QuillCacheError,
    "A KV-event payload could not be decoded; the message says what and at which byte."
);
create_exception!(
    quillcache._native,
    HashingError,
    QuillCacheError,
    "Invalid input to block hashing (e.g. a token id that does not fit in 32 bits)."
);

// Persistence errors (`durable.rs`, `kv_index.rs`). Declared here, with the full
// module path, so that `__module__` is `quillcache._native` like the others.
create_exception!(
    quillcache._native,
    PersistenceError,
    QuillCacheError,
    "The durable index could not read or write its directory (the message names the file)."
);
create_exception!(
    quillcache._native,
    CorruptIndexError,
    PersistenceError,
    "The write-ahead log or a snapshot is damaged in a way that is not a torn tail."
);
create_exception!(
    quillcache._native,
    IngestRefusedError,
    PersistenceError,
    "A write failed earlier (e.g. disk full): the index keeps its logged state and refuses changes."
);
create_exception!(
    quillcache._native,
    IndexLockedError,
    PersistenceError,
    "Another process holds the index directory."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("QuillCacheError", py.get_type::<QuillCacheError>())?;
    m.add("EventDecodeError", py.get_type::<EventDecodeError>())?;
    m.add("HashingError", py.get_type::<HashingError>())?;
    m.add("PersistenceError", py.get_type::<PersistenceError>())?;
    m.add("CorruptIndexError", py.get_type::<CorruptIndexError>())?;
    m.add("IngestRefusedError", py.get_type::<IngestRefusedError>())?;
    m.add("IndexLockedError", py.get_type::<IndexLockedError>())?;
    // Keep ValueError importable for callers that catch it generically.
    let _ = py.get_type::<PyValueError>();
    Ok(())
}

/// Every error of `quillcache-core` that reaches Python, with the context its message
/// needs. `PyErr::from` is the one place that picks the exception class.
#[derive(Debug)]
pub(crate) enum CoreError {
    /// A payload of an `apply` did not decode (boxed: the stats are large and an
    /// error is rare).
    Payload(Box<PayloadFailure>),
    /// A batch given to `decode_batch` did not decode.
    Decode(DecodeError),
    /// `failed`: the index was refusing changes once the call returned (a write of
    /// this call failed), so an I/O error is a refusal, not a passing one.
    Persist {
        error: PersistError,
        failed: bool,
    },
    Kv(KvIndexError),
    Snapshot(SnapshotError),
    Reserve(ReserveError),
}

/// Payload `index` of the `count` given for `worker` did not decode (in item `item` of
/// an `apply_many`); `applied`: what the call applied before it, which stays applied.
#[derive(Debug)]
pub(crate) struct PayloadFailure {
    pub item: Option<usize>,
    pub worker: u64,
    pub index: usize,
    pub count: usize,
    pub message: String,
    pub applied: ApplyStats,
}

impl From<CoreError> for PyErr {
    fn from(e: CoreError) -> PyErr {
        match e {
            CoreError::Payload(failure) => {
                let PayloadFailure {
                    item,
                    worker,
                    index,
                    count,
                    message,
                    applied,
                } = *failure;
                let at = format!("payload {index} of {count} from worker {worker}: {message}");
                let err = EventDecodeError::new_err(match item {
                    Some(i) => format!("item {i}: {at}"),
                    None => at,
                });
                Python::attach(|py| {
                    let value = err.value(py);
                    // Setting attributes on a fresh exception instance cannot fail in
                    // practice; if it did, the error without them is still the one to raise.
                    if let Some(i) = item {
                        let _ = value.setattr("item_index", i);
                    }
                    let _ = value.setattr("payload_index", index);
                    let _ = value.setattr("stats", stats_tuple(&applied));
                });
                err
            }
            CoreError::Decode(e) => {
                let err = EventDecodeError::new_err(e.to_string());
                Python::attach(|py| {
                    let _ = err.value(py).setattr("offset", e.offset);
                });
                err
            }
            CoreError::Persist { error, failed } => persist_error(error, failed),
            CoreError::Kv(e) => kv_error(e),
            CoreError::Snapshot(e) => QuillCacheError::new_err(e.to_string()),
            CoreError::Reserve(e @ ReserveError::TooLarge { .. }) => {
                PyValueError::new_err(e.to_string())
            }
            CoreError::Reserve(e @ ReserveError::OutOfMemory { .. }) => {
                PyMemoryError::new_err(e.to_string())
            }
        }
    }
}

fn persist_error(e: PersistError, failed: bool) -> PyErr {
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

fn kv_error(e: KvIndexError) -> PyErr {
    match e {
        KvIndexError::Decode(m) => EventDecodeError::new_err(m),
        // Only `open_store` names the "backend": a store this build does not have.
        KvIndexError::Store(e) if e.store == "backend" => QuillCacheError::new_err(e.message),
        KvIndexError::Store(e) if e.kind == KvErrorKind::Refused => {
            IngestRefusedError::new_err(e.to_string())
        }
        KvIndexError::Store(e) => PersistenceError::new_err(e.to_string()),
        KvIndexError::Corrupt { .. } => CorruptIndexError::new_err(e.to_string()),
    }
}

impl From<PayloadFailure> for CoreError {
    fn from(f: PayloadFailure) -> Self {
        CoreError::Payload(Box::new(f))
    }
}

impl From<PayloadFailure> for PyErr {
    fn from(f: PayloadFailure) -> Self {
        CoreError::from(f).into()
    }
}

impl From<Infallible> for CoreError {
    fn from(e: Infallible) -> Self {
        match e {}
    }
}

impl From<DecodeError> for CoreError {
    fn from(e: DecodeError) -> Self {
        CoreError::Decode(e)
    }
}

/// A persistence error of a call that did not leave the index refusing changes.
impl From<PersistError> for CoreError {
    fn from(error: PersistError) -> Self {
        CoreError::Persist {
            error,
            failed: false,
        }
    }
}

impl From<KvIndexError> for CoreError {
    fn from(e: KvIndexError) -> Self {
        CoreError::Kv(e)
    }
}

impl From<KvError> for CoreError {
    fn from(e: KvError) -> Self {
        CoreError::Kv(e.into())
    }
}

impl From<SnapshotError> for CoreError {
    fn from(e: SnapshotError) -> Self {
        CoreError::Snapshot(e)
    }
}

impl From<ReserveError> for CoreError {
    fn from(e: ReserveError) -> Self {
        CoreError::Reserve(e)
    }
}

/// `result.or_raise()?`: a core call's error raised as its Python exception.
pub(crate) trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T, E: Into<CoreError>> OrRaise<T> for Result<T, E> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(|e| PyErr::from(e.into()))
    }
}

/// A call on a `DurableIndex` or `KvIndex` after `close`.
pub(crate) fn closed() -> PyErr {
    QuillCacheError::new_err("the durable index is closed")
}
