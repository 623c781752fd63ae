//! `PendingPrefixes`: `quillcache_core::speculative::Pending` for the control plane.
//! Used by the plane's routing thread only, so PyO3's own borrow check is enough.

use numpy::{PyArray1, PyReadonlyArray1};
use pyo3::prelude::*;

use quillcache_core::speculative::Pending;

use crate::convert::keys_slice;

#[pyclass(module = "quillcache._native", name = "PendingPrefixes")]
#[derive(Default)]
pub struct PendingPrefixes {
    inner: Pending,
}

#[pymethods]
impl PendingPrefixes {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// One more request computing `keys` on `worker`.
    fn add(&mut self, worker: u64, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        self.inner.add(worker, keys_slice(&keys)?);
        Ok(())
    }

    /// One request fewer computing `keys` on `worker`.
    fn remove(&mut self, worker: u64, keys: PyReadonlyArray1<'_, u64>) -> PyResult<()> {
        self.inner.remove(worker, keys_slice(&keys)?);
        Ok(())
    }

    fn remove_worker(&mut self, worker: u64) {
        self.inner.remove_worker(worker);
    }

    /// `(workers, blocks)`: per worker, how many of `keys` from the first are being
    /// computed there (workers with none omitted).
    #[allow(clippy::type_complexity)]
    fn prefixes<'py>(
        &self,
        py: Python<'py>,
        keys: PyReadonlyArray1<'py, u64>,
    ) -> PyResult<(Bound<'py, PyArray1<u64>>, Bound<'py, PyArray1<u32>>)> {
        let (workers, blocks): (Vec<u64>, Vec<u32>) =
            self.inner.prefixes(keys_slice(&keys)?).into_iter().unzip();
        Ok((
            PyArray1::from_vec(py, workers),
            PyArray1::from_vec(py, blocks),
        ))
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PendingPrefixes>()
}
