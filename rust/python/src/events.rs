//! `decode_batch` for Python: decode with the GIL released, then build the dataclasses
//! of `quillcache.events.types` (the same ones the pure-Python reference returns).

use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString, PyTuple};

use quillcache_core::content_key::MmItem;
use quillcache_core::events::{self, Event, EventBatch, ExtraKey, StoredIdentity};

use crate::errors::OrRaise;

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
    let batch = py.detach(|| events::decode_batch(payload)).or_raise()?;
    batch_object(py, &batch)
}

/// The inverse of `extra_key`: a `str`, `MmKey` or `RawKey` as the core's `ExtraKey`.
fn extra_key_of(c: &Classes, k: &Bound<'_, PyAny>) -> PyResult<ExtraKey> {
    let py = k.py();
    if let Ok(s) = k.cast::<PyString>() {
        return Ok(ExtraKey::Str(s.to_str()?.to_owned()));
    }
    if k.is_instance(c.mm.bind(py))? {
        return Ok(ExtraKey::Mm {
            hash: k.getattr(intern!(py, "hash"))?.extract()?,
            offset: k.getattr(intern!(py, "offset"))?.extract()?,
        });
    }
    if k.is_instance(c.raw.bind(py))? {
        let raw = k.getattr(intern!(py, "msgpack"))?;
        return Ok(ExtraKey::Raw(raw.cast::<PyBytes>()?.as_bytes().to_vec()));
    }
    Err(PyTypeError::new_err(format!(
        "an extra key is a str, MmKey or RawKey, not {}",
        k.get_type().name()?
    )))
}

/// `(lora, tenant, mm per block)`.
type Identity = (String, String, Vec<Option<Vec<MmItem>>>);

/// `(lora, tenant, mm)` of a BlockStored from its `cache_salt`, `lora_name` and
/// `extra_keys`: its namespace's LoRA and tenant, and each block's multimodal items
/// (None for a block without). The core's rule (`StoredIdentity`), for the Python
/// reference index.
#[pyfunction]
fn stored_identity(
    py: Python<'_>,
    cache_salt: Option<&str>,
    lora_name: Option<&str>,
    extra_keys: Option<Vec<Option<Vec<Bound<'_, PyAny>>>>>,
) -> PyResult<Identity> {
    let c = classes(py)?;
    let extra_keys = extra_keys
        .unwrap_or_default()
        .iter()
        .map(|block| match block {
            None => Ok(None),
            Some(keys) => keys
                .iter()
                .map(|k| extra_key_of(c, k))
                .collect::<PyResult<Vec<_>>>()
                .map(Some),
        })
        .collect::<PyResult<Vec<_>>>()?;
    let id = StoredIdentity {
        cache_salt,
        lora_name,
        extra_keys: &extra_keys,
    };
    let mm = (0..extra_keys.len()).map(|i| id.mm_items(i)).collect();
    Ok((id.lora().to_owned(), id.tenant().to_owned(), mm))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(decode_batch, m)?)?;
    m.add_function(wrap_pyfunction!(stored_identity, m)?)?;
    m.add("MAX_EVENT_DEPTH", events::MAX_DEPTH)?;
    // the medium-name bounds, so that the Python reference index applies the same ones
    m.add("MAX_MEDIUM_NAME_BYTES", events::MAX_MEDIUM_NAME_BYTES)?;
    m.add("MAX_CUSTOM_MEDIA", events::MAX_CUSTOM_MEDIA)?;
    m.add("OTHER_MEDIUM", events::OTHER_MEDIUM)?;
    m.add("KNOWN_MEDIA", PyTuple::new(m.py(), events::KNOWN_MEDIA)?)?;
    Ok(())
}
