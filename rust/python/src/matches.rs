//! The hits of a `match` as `quillcache.index.types.Match` objects, handed out from a
//! cache.
//!
//! A request's hits come from a small set (workers x dp ranks x media x prefix lengths)
//! and a `Match` is immutable, so a cached object is shared. Looking one up costs a
//! fraction of building a tuple that Python then converts, which was a third of a
//! `match` seen from Python (docs/index.md, "Numbers").

use std::sync::Mutex;

use hashbrown::HashMap;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyList, PyString};

use quillcache_core::events::Medium;
use quillcache_core::index::NamedHit;

/// The cache is cleared when it reaches this size, so a long-lived process with
/// unusual churn (many workers, long prefixes) keeps a bounded set.
const MAX_CACHED: usize = 1 << 16;

struct Matches {
    class: Py<PyAny>,
    /// hashbrown's default hasher: std's SipHash showed up in a `match`'s profile.
    cache: Mutex<HashMap<NamedHit, Py<PyAny>>>,
}

static MATCHES: PyOnceLock<Matches> = PyOnceLock::new();

fn matches(py: Python<'_>) -> PyResult<&Matches> {
    MATCHES.get_or_try_init(py, || {
        let class = PyModule::import(py, "quillcache.index.types")?.getattr("Match")?;
        Ok(Matches {
            class: class.unbind(),
            cache: Mutex::new(HashMap::new()),
        })
    })
}

/// The name of a medium as a Python string; the common ones are interned.
fn medium_str<'py>(py: Python<'py>, m: &Medium) -> Bound<'py, PyString> {
    match m {
        Medium::Gpu => intern!(py, "GPU").clone(),
        Medium::Cpu => intern!(py, "CPU").clone(),
        Medium::Disk => intern!(py, "DISK").clone(),
        Medium::Other(s) => PyString::new(py, s),
    }
}

/// `[Match, ...]` for the hits, in their order.
///
/// The cache's lock is held only around map operations, never across a call into
/// Python (building a `Match` runs Python code, during which another thread may take
/// the GIL and come here).
pub(crate) fn match_list<'py>(py: Python<'py>, hits: &[NamedHit]) -> PyResult<Bound<'py, PyList>> {
    let m = matches(py)?;
    let lock = || m.cache.lock().unwrap_or_else(|e| e.into_inner());
    let mut objs = Vec::with_capacity(hits.len());
    for hit in hits {
        let cached = lock().get(hit).map(|obj| obj.clone_ref(py));
        let obj = match cached {
            Some(obj) => obj,
            None => {
                let args = (
                    hit.worker,
                    hit.dp_rank,
                    medium_str(py, &hit.medium),
                    hit.blocks,
                );
                let obj = m.class.bind(py).call1(args)?.unbind();
                let evicted = {
                    let mut cache = lock();
                    let evicted = (cache.len() >= MAX_CACHED).then(|| std::mem::take(&mut *cache));
                    cache.insert(hit.clone(), obj.clone_ref(py));
                    evicted
                };
                drop(evicted); // decrefs outside the lock
                obj
            }
        };
        objs.push(obj);
    }
    PyList::new(py, objs)
}
