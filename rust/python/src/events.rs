//! `decode_batch` for Python: decode with the GIL released, then build the dataclasses
//! of `quillcache.events.types` (the same ones the pure-Python reference returns).

use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyTuple};

use quillcache_core::events::{self, Event, EventBatch, ExtraKey};

use crate::errors::EventDecodeError;

/// The Python classes of `quillcache.events.types`, looked up once.
struct Classes {
    batch: Py<PyAny>,
    stored: Py<PyAny>,
    removed: Py<PyAny>,
    cleared: Py<PyAny>,
    mm: Py<PyAny>,
    raw: Py<PyAny>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || {
        let m = PyModule::import(py, "quillcache.events.types")?;
        let get = |name: &str| m.getattr(name).map(Bound::unbind);
        Ok(Classes {
            batch: get("EventBatch")?,
            stored: get("BlockStored")?,
            removed: get("BlockRemoved")?,
            cleared: get("AllBlocksCleared")?,
            mm: get("MmKey")?,
            raw: get("RawKey")?,
        })
    })
}

fn extra_key<'py>(py: Python<'py>, c: &Classes, k: &ExtraKey) -> PyResult<Bound<'py, PyAny>> {
    match k {
        ExtraKey::Str(s) => Ok(s.into_pyobject(py)?.into_any()),
        ExtraKey::Mm { hash, offset } => c.mm.bind(py).call1((hash, *offset)),
        ExtraKey::Raw(raw) => c.raw.bind(py).call1((PyBytes::new(py, raw),)),
    }
}

fn event<'py>(py: Python<'py>, c: &Classes, e: &Event) -> PyResult<Bound<'py, PyAny>> {
    match e {
        Event::BlockStored(s) => {
            let extra = s
                .extra_keys
                .iter()
                .map(|block| match block {
                    None => Ok(py.None().into_bound(py)),
                    Some(items) => {
                        let items = items
                            .iter()
                            .map(|k| extra_key(py, c, k))
                            .collect::<PyResult<Vec<_>>>()?;
                        Ok(PyTuple::new(py, items)?.into_any())
                    }
                })
                .collect::<PyResult<Vec<_>>>()?;
            c.stored.bind(py).call1((
                PyTuple::new(py, &s.block_hashes)?,
                s.parent_block_hash,
                PyTuple::new(py, &s.token_ids)?,
                s.block_size,
                s.lora_id,
                s.medium.as_str(),
                s.lora_name.as_deref(),
                PyTuple::new(py, extra)?,
                s.group_idx,
                s.cache_salt.as_deref(),
            ))
        }
        Event::BlockRemoved(r) => c.removed.bind(py).call1((
            PyTuple::new(py, &r.block_hashes)?,
            r.medium.as_str(),
            r.group_idx,
        )),
        Event::AllBlocksCleared => c.cleared.bind(py).call0(),
    }
}

fn batch_object<'py>(py: Python<'py>, b: &EventBatch) -> PyResult<Bound<'py, PyAny>> {
    let c = classes(py)?;
    let events = b
        .events
        .iter()
        .map(|e| event(py, c, e))
        .collect::<PyResult<Vec<_>>>()?;
    c.batch
        .bind(py)
        .call1((b.ts, PyTuple::new(py, events)?, b.dp_rank))
}

/// Decodes one msgpack event batch into `quillcache.events.types.EventBatch`.
/// Raises `EventDecodeError` (with `.offset`, the byte where it went wrong).
#[pyfunction]
fn decode_batch<'py>(py: Python<'py>, payload: &[u8]) -> PyResult<Bound<'py, PyAny>> {
    match py.detach(|| events::decode_batch(payload)) {
        Ok(batch) => batch_object(py, &batch),
        Err(e) => {
            let err = EventDecodeError::new_err(e.to_string());
            err.value(py).setattr("offset", e.offset)?;
            Err(err)
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add("MAX_EVENT_DEPTH", events::MAX_DEPTH)?;
    // the medium-name bounds, so that the Python reference index applies the same ones
    m.add("MAX_MEDIUM_NAME_BYTES", events::MAX_MEDIUM_NAME_BYTES)?;
    m.add("MAX_CUSTOM_MEDIA", events::MAX_CUSTOM_MEDIA)?;
    m.add("OTHER_MEDIUM", events::OTHER_MEDIUM)?;
    m.add("KNOWN_MEDIA", PyTuple::new(m.py(), events::KNOWN_MEDIA)?)?;
    Ok(())
}
