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

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("QuillCacheError", py.get_type::<QuillCacheError>())?;
    m.add("EventDecodeError", py.get_type::<EventDecodeError>())?;
    m.add("HashingError", py.get_type::<HashingError>())?;
    // Keep ValueError importable for callers that catch it generically.
    let _ = py.get_type::<PyValueError>();
    Ok(())
}
