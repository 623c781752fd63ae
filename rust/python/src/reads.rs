//! The read methods the three index classes share (`match`, `match_many`, `scan`,
//! `entries`, `stats`), written once over `quillcache_core::index::IndexRead`. Each
//! class's `#[pymethods]` converts its arguments and calls these.
//!
//! Lock discipline: a lock is taken and released entirely inside `py.detach`. A
//! thread that held the lock while waiting to get the GIL back would deadlock with a
//! thread that holds the GIL while waiting for the lock (seen: the gateway's ingest
//! thread applying while its event loop matched). Reads share the lock (an `RwLock`
//! read); every class takes it the same way, through [`Locked`].

use std::sync::RwLock;

use pyo3::prelude::*;
use pyo3::types::PyList;

use quillcache_core::index::{Index, IndexRead, NamedHit};

use crate::convert::{entries_list, index_stats_tuple, IndexStatsTuple};
use crate::errors::{closed, CoreError, OrRaise};
use crate::matches::match_list;

/// An index behind a class's lock.
pub(crate) trait Locked: Sync {
    type Index: IndexRead<Error: Into<CoreError> + Send>;

    /// Runs `f` on the index under the read lock; None once the index is closed.
    /// Only with the GIL released (see the module docs).
    fn read_with<T>(&self, f: impl FnOnce(&Self::Index) -> T) -> Option<T>;
}

/// `NativeIndex`'s: never closed.
impl Locked for RwLock<Index> {
    type Index = Index;

    fn read_with<T>(&self, f: impl FnOnce(&Index) -> T) -> Option<T> {
        // A poisoned lock means a panic mid-update; the index is still memory-safe.
        Some(f(&self.read().unwrap_or_else(|e| e.into_inner())))
    }
}

/// `DurableIndex`'s and `KvIndex`'s: None once `close` took the index.
impl<I> Locked for RwLock<Option<I>>
where
    I: IndexRead<Error: Into<CoreError> + Send> + Send + Sync,
{
    type Index = I;

    fn read_with<T>(&self, f: impl FnOnce(&I) -> T) -> Option<T> {
        self.read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(f)
    }
}

/// `f` on the index under its read lock, the GIL released for both.
pub(crate) fn read<L: Locked, T: Send>(
    py: Python<'_>,
    lock: &L,
    f: impl FnOnce(&L::Index) -> T + Send,
) -> PyResult<T> {
    py.detach(|| lock.read_with(f)).ok_or_else(closed)
}

/// `match`: `[Match, ...]` sorted by (worker, dp_rank, medium).
pub(crate) fn match_keys<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    keys: &[u64],
) -> PyResult<Bound<'py, PyList>> {
    let hits = read(py, lock, |ix| ix.matches(keys))?.or_raise()?;
    match_list(py, &hits)
}

/// `match_many`: one `match` per request, the GIL released once for the whole list
/// and the lock taken per request (an ingest waits behind one match, not the list).
pub(crate) fn match_many<'py, L: Locked, K: AsRef<[u64]> + Sync>(
    py: Python<'py>,
    lock: &L,
    requests: &[K],
) -> PyResult<Bound<'py, PyList>> {
    // Err(None): the index is closed.
    let all = py.detach(|| {
        requests
            .iter()
            .map(|k| match lock.read_with(|ix| ix.matches(k.as_ref())) {
                Some(hits) => hits.map_err(Some),
                None => Err(None),
            })
            .collect::<Result<Vec<Vec<NamedHit>>, Option<_>>>()
    });
    let all = match all {
        Ok(all) => all,
        Err(Some(e)) => return Err(PyErr::from(e.into())),
        Err(None) => return Err(closed()),
    };
    let out = PyList::empty(py);
    for hits in &all {
        out.append(match_list(py, hits)?)?;
    }
    Ok(out)
}

/// `scan`: the entries under `prefix`, sorted by key.
pub(crate) fn scan<'py, L: Locked>(
    py: Python<'py>,
    lock: &L,
    prefix: &[u64],
) -> PyResult<Bound<'py, PyList>> {
    let entries = read(py, lock, |ix| ix.scan(prefix))?.or_raise()?;
    entries_list(py, &entries)
}

/// `entries`: every block with a holder or a pin.
pub(crate) fn entries<'py, L: Locked>(py: Python<'py>, lock: &L) -> PyResult<Bound<'py, PyList>> {
    let entries = read(py, lock, |ix| ix.entries())?.or_raise()?;
    entries_list(py, &entries)
}

/// `stats`: `(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
/// media_folded)`.
pub(crate) fn stats<L: Locked>(py: Python<'_>, lock: &L) -> PyResult<IndexStatsTuple> {
    let s = read(py, lock, |ix| ix.stats())?.or_raise()?;
    Ok(index_stats_tuple(&s))
}
