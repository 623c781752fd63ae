//! Identity and block hashing for Python: `Namespace`, QuillCache content keys
//! (numpy in, numpy out, GIL released) and vLLM `sha256_cbor` parity.

use std::borrow::Cow;

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyString};

use quillcache_core::content_key::{
    chain_block, chain_keys, chain_keys_batch, chain_keys_mm, MmItem,
};
use quillcache_core::namespace::Namespace as CoreNamespace;
use quillcache_core::vllm_hash::{self, BlockExtra, CborItem, Digest};

use crate::errors::HashingError;

// ---- token arrays ----------------------------------------------------------------

/// Token ids borrowed from numpy when they already are contiguous uint32, else copied.
enum TokenSource<'py> {
    U32(PyReadonlyArray1<'py, u32>),
    I64(PyReadonlyArray1<'py, i64>),
    List(Vec<i64>),
}

impl<'py> TokenSource<'py> {
    fn extract(obj: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u32>>() {
            return Ok(TokenSource::U32(a));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i64>>() {
            return Ok(TokenSource::I64(a));
        }
        if obj.is_instance_of::<PyList>() {
            if let Ok(v) = obj.extract::<Vec<i64>>() {
                return Ok(TokenSource::List(v));
            }
        }
        let kind = match obj.getattr("dtype") {
            Ok(d) => format!("an array of dtype {d} with {} dimension(s)", ndim(obj)),
            Err(_) => format!("a {}", obj.get_type().name()?),
        };
        Err(HashingError::new_err(format!(
            "tokens must be a 1-D numpy array of uint32 or int64 (or a list of ints), got {kind}; \
             convert with np.asarray(tokens, dtype=np.uint32)"
        )))
    }

    /// Runs `f` on the tokens as u32 with the GIL released, after checking the range.
    fn with_u32<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&[u32]) -> R + Send) -> PyResult<R> {
        let checked: Result<R, (usize, i64)> = match self {
            TokenSource::U32(a) => match a.as_slice() {
                Ok(s) => Ok(py.detach(|| f(s))),
                Err(_) => {
                    let v: Vec<u32> = a.as_array().iter().copied().collect();
                    Ok(py.detach(|| f(&v)))
                }
            },
            TokenSource::I64(a) => match a.as_slice() {
                Ok(s) => py.detach(|| narrow(s.iter().copied()).map(|v| f(&v))),
                Err(_) => {
                    let v: Vec<i64> = a.as_array().iter().copied().collect();
                    py.detach(|| narrow(v.iter().copied()).map(|v| f(&v)))
                }
            },
            TokenSource::List(v) => py.detach(|| narrow(v.iter().copied()).map(|v| f(&v))),
        };
        checked.map_err(|(index, value)| {
            HashingError::new_err(format!(
                "token id {value} at index {index} does not fit in 32 bits (0..=4294967295); \
                 token ids are never truncated"
            ))
        })
    }
}

fn ndim(obj: &Bound<'_, PyAny>) -> String {
    obj.getattr("ndim")
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// int64 → u32, or the first (index, value) out of range.
fn narrow(values: impl Iterator<Item = i64>) -> Result<Vec<u32>, (usize, i64)> {
    values
        .enumerate()
        .map(|(i, t)| u32::try_from(t).map_err(|_| (i, t)))
        .collect()
}

fn check_block_size(block_size: i64) -> PyResult<usize> {
    if block_size < 1 || block_size > u32::MAX as i64 {
        return Err(HashingError::new_err(format!(
            "block_size must be a positive number of tokens (1..=4294967295), got {block_size}"
        )));
    }
    Ok(block_size as usize)
}

// ---- namespaces ----------------------------------------------------------------------

/// Everything that decides whether two blocks with equal tokens may share KV.
#[pyclass(frozen, eq, hash, module = "quillcache._native", name = "Namespace")]
#[derive(PartialEq, Eq, Hash)]
pub struct Namespace {
    inner: CoreNamespace,
}

#[pymethods]
impl Namespace {
    #[new]
    #[pyo3(signature = (model = String::new(), tokenizer = String::new(), lora = String::new(),
                        tenant = String::new(), block_size = 16, extra = Vec::new()))]
    fn new(
        model: String,
        tokenizer: String,
        lora: String,
        tenant: String,
        block_size: i64,
        extra: Vec<String>,
    ) -> PyResult<Self> {
        let block_size = check_block_size(block_size)? as u32;
        Ok(Namespace {
            inner: CoreNamespace {
                model,
                tokenizer,
                lora,
                tenant,
                block_size,
                extra,
            },
        })
    }

    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }
    #[getter]
    fn tokenizer(&self) -> &str {
        &self.inner.tokenizer
    }
    #[getter]
    fn lora(&self) -> &str {
        &self.inner.lora
    }
    #[getter]
    fn tenant(&self) -> &str {
        &self.inner.tenant
    }
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.block_size
    }
    #[getter]
    fn extra(&self) -> Vec<String> {
        self.inner.extra.clone()
    }

    /// The stable 64-bit namespace id: the root of every content-key chain.
    #[getter]
    fn id(&self) -> u64 {
        self.inner.id()
    }

    /// The exact bytes `id` hashes (`docs/content-key.md`), for cross-checking.
    fn canonical_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.canonical_bytes())
    }

    /// Content keys of every full block of `tokens` in this namespace.
    fn content_keys<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let parent = self.inner.id();
        let bs = self.inner.block_size as usize;
        let keys = TokenSource::extract(tokens)?.with_u32(py, |t| {
            let mut out = Vec::new();
            chain_keys(parent, t, bs, &mut out);
            out
        })?;
        Ok(PyArray1::from_vec(py, keys))
    }

    fn __repr__(&self) -> String {
        let n = &self.inner;
        format!(
            "Namespace(model={:?}, tokenizer={:?}, lora={:?}, tenant={:?}, block_size={}, extra={:?})",
            n.model, n.tokenizer, n.lora, n.tenant, n.block_size, n.extra
        )
    }
}

#[pyfunction]
#[pyo3(signature = (model = String::new(), tokenizer = String::new(), lora = String::new(),
                    tenant = String::new(), block_size = 16, extra = Vec::new()))]
fn namespace_id(
    model: String,
    tokenizer: String,
    lora: String,
    tenant: String,
    block_size: i64,
    extra: Vec<String>,
) -> PyResult<u64> {
    Ok(
        Namespace::new(model, tokenizer, lora, tenant, block_size, extra)?
            .inner
            .id(),
    )
}

// ---- content keys --------------------------------------------------------------------

type MmPerBlock = Vec<Option<Vec<MmItem>>>;

fn extract_mm(mm: Option<&Bound<'_, PyAny>>) -> PyResult<Option<MmPerBlock>> {
    let Some(mm) = mm.filter(|m| !m.is_none()) else {
        return Ok(None);
    };
    mm.extract::<Vec<Option<Vec<(String, i64)>>>>()
        .map(Some)
        .map_err(|_| {
            HashingError::new_err(
                "mm must be a list with one entry per block: None, or a list of \
             (mm_hash: str, offset_in_block: int) pairs",
            )
        })
}

/// Content keys of every full block of `tokens`, chained from `parent`.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, parent, *, mm = None))]
fn content_keys<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    parent: u64,
    mm: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let bs = check_block_size(block_size)?;
    let mm = extract_mm(mm)?;
    let keys = TokenSource::extract(tokens)?.with_u32(py, |t| {
        let mut out = Vec::new();
        match &mm {
            None => chain_keys(parent, t, bs, &mut out),
            Some(mm) => chain_keys_mm(parent, t, bs, mm, &mut out),
        }
        out
    })?;
    Ok(PyArray1::from_vec(py, keys))
}

/// The key of one block (any length) chained onto `parent`.
#[pyfunction]
#[pyo3(signature = (parent, tokens, mm = None))]
fn block_key(
    py: Python<'_>,
    parent: u64,
    tokens: &Bound<'_, PyAny>,
    mm: Option<Vec<(String, i64)>>,
) -> PyResult<u64> {
    TokenSource::extract(tokens)?.with_u32(py, |t| chain_block(parent, t, mm.as_deref()))
}

/// Keys of many sequences in one call: sequence j is `tokens[offsets[j]:offsets[j+1]]`.
/// Returns `(keys, key_offsets)`: sequence j's keys are `keys[key_offsets[j]:key_offsets[j+1]]`.
/// Flat keys of many sequences and the offsets of each sequence's keys in them.
type KeysWithOffsets<'py> = (Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<i64>>);

#[pyfunction]
#[pyo3(signature = (tokens, offsets, block_size, parents))]
fn content_keys_batch<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    offsets: PyReadonlyArray1<'py, i64>,
    block_size: i64,
    parents: &Bound<'py, PyAny>,
) -> PyResult<KeysWithOffsets<'py>> {
    let bs = check_block_size(block_size)?;
    let offsets: Cow<[i64]> = match offsets.as_slice() {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => Cow::Owned(offsets.as_array().to_vec()),
    };
    let n_seq = offsets.len().saturating_sub(1);
    let parents: Vec<u64> = if let Ok(p) = parents.extract::<u64>() {
        vec![p; n_seq]
    } else {
        let p = parents
            .extract::<PyReadonlyArray1<'py, u64>>()
            .map_err(|_| HashingError::new_err("parents must be an int or a 1-D uint64 array"))?;
        p.as_array().to_vec()
    };
    if parents.len() != n_seq {
        return Err(HashingError::new_err(format!(
            "parents has {} entries, but offsets describe {n_seq} sequences",
            parents.len()
        )));
    }
    let source = TokenSource::extract(tokens)?;
    let result = source.with_u32(py, |t| -> Result<(Vec<u64>, Vec<i64>), String> {
        let mut bounds = Vec::with_capacity(offsets.len());
        for (j, &o) in offsets.iter().enumerate() {
            let prev = bounds.last().copied().unwrap_or(0);
            if o < 0 || o as u64 > t.len() as u64 || (o as usize) < prev {
                return Err(format!(
                    "offsets[{j}] = {o} is out of order or outside 0..={}",
                    t.len()
                ));
            }
            bounds.push(o as usize);
        }
        let mut keys = Vec::new();
        let ends = chain_keys_batch(|j| parents[j], t, &bounds, bs, &mut keys);
        let mut key_offsets = Vec::with_capacity(ends.len() + 1);
        key_offsets.push(0);
        key_offsets.extend(ends.iter().map(|&e| e as i64));
        Ok((keys, key_offsets))
    })?;
    let (keys, key_offsets) = result.map_err(HashingError::new_err)?;
    Ok((
        PyArray1::from_vec(py, keys),
        PyArray1::from_vec(py, key_offsets),
    ))
}

// ---- vLLM parity -------------------------------------------------------------------

fn cbor_item(obj: &Bound<'_, PyAny>) -> PyResult<CborItem> {
    if obj.is_instance_of::<PyString>() {
        return Ok(CborItem::Text(obj.extract()?));
    }
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(CborItem::Bytes(b.as_bytes().to_vec()));
    }
    if !obj.is_instance_of::<PyBool>() {
        if let Ok(v) = obj.extract::<i128>() {
            return CborItem::int(v).ok_or_else(|| {
                HashingError::new_err(format!(
                    "extra key int {v} does not fit in CBOR (|v| < 2^64)"
                ))
            });
        }
    }
    Err(HashingError::new_err(format!(
        "extra key items must be str, int or bytes, got {}",
        obj.get_type().name()?
    )))
}

fn extract_extra(extra: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Option<BlockExtra>>> {
    let Some(extra) = extra.filter(|e| !e.is_none()) else {
        return Ok(Vec::new());
    };
    let shape_error = || {
        HashingError::new_err(
            "extra_keys must be a list with one entry per block: None, or a tuple of \
             tuples of str/int/bytes, e.g. ((\"lora\", name, path), (\"mm\", hash, offset))",
        )
    };
    let mut out = Vec::new();
    for block in extra.try_iter().map_err(|_| shape_error())? {
        let block = block?;
        if block.is_none() {
            out.push(None);
            continue;
        }
        let mut keys = Vec::new();
        for key in block.try_iter().map_err(|_| shape_error())? {
            let key = key?;
            if key.is_instance_of::<PyString>() || key.is_instance_of::<PyBytes>() {
                return Err(shape_error());
            }
            let items = key
                .try_iter()
                .map_err(|_| shape_error())?
                .map(|i| cbor_item(&i?))
                .collect::<PyResult<Vec<_>>>()?;
            keys.push(items);
        }
        out.push(Some(keys));
    }
    Ok(out)
}

fn extract_parent(parent: Option<&[u8]>, seed: &str) -> PyResult<Digest> {
    match parent {
        None => Ok(vllm_hash::none_hash(seed)),
        Some(p) => p.try_into().map_err(|_| {
            HashingError::new_err(format!(
                "parent must be a full 32-byte sha256 digest, got {} bytes",
                p.len()
            ))
        }),
    }
}

fn vllm_digests(
    py: Python<'_>,
    tokens: &Bound<'_, PyAny>,
    block_size: i64,
    seed: &str,
    extra_keys: Option<&Bound<'_, PyAny>>,
    parent: Option<&[u8]>,
) -> PyResult<Vec<Digest>> {
    let bs = check_block_size(block_size)?;
    let extra = extract_extra(extra_keys)?;
    let parent = extract_parent(parent, seed)?;
    TokenSource::extract(tokens)?.with_u32(py, |t| vllm_hash::block_hashes(&parent, t, bs, &extra))
}

/// vLLM's `NONE_HASH` for `sha256_cbor`: SHA-256 of the CBOR text `seed`.
#[pyfunction]
#[pyo3(signature = (seed = vllm_hash::DEFAULT_SEED))]
fn vllm_none_hash<'py>(py: Python<'py>, seed: &str) -> Bound<'py, PyBytes> {
    PyBytes::new(py, &vllm_hash::none_hash(seed))
}

/// Full `sha256_cbor` digests of every full block, exactly as vLLM computes them.
#[pyfunction]
#[pyo3(signature = (tokens, block_size, *, seed = vllm_hash::DEFAULT_SEED, extra_keys = None, parent = None))]
fn vllm_block_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    seed: &str,
    extra_keys: Option<&Bound<'py, PyAny>>,
    parent: Option<&[u8]>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    let digests = vllm_digests(py, tokens, block_size, seed, extra_keys, parent)?;
    Ok(digests.iter().map(|d| PyBytes::new(py, d)).collect())
}

/// The 64-bit values vLLM's KV events carry for those blocks (last 8 bytes, big-endian).
#[pyfunction]
#[pyo3(signature = (tokens, block_size, *, seed = vllm_hash::DEFAULT_SEED, extra_keys = None, parent = None))]
fn vllm_event_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    block_size: i64,
    seed: &str,
    extra_keys: Option<&Bound<'py, PyAny>>,
    parent: Option<&[u8]>,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    let digests = vllm_digests(py, tokens, block_size, seed, extra_keys, parent)?;
    let values = digests.iter().map(vllm_hash::event_hash).collect();
    Ok(PyArray1::from_vec(py, values))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Namespace>()?;
    m.add_function(wrap_pyfunction!(namespace_id, m)?)?;
    m.add_function(wrap_pyfunction!(content_keys, m)?)?;
    m.add_function(wrap_pyfunction!(content_keys_batch, m)?)?;
    m.add_function(wrap_pyfunction!(block_key, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_none_hash, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(vllm_event_hashes, m)?)?;
    Ok(())
}
