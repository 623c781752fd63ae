//! The exception hierarchy of `quillcache._native` (re-exported by `quillcache.errors`).

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

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

// Persistence errors (`rust/python/src/persist.rs`). Declared here, with the full
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
