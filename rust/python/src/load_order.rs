//! `LoadOrder`: `quillcache_core::load_order` for the control plane's pruned views.

use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use quillcache_core::load_order::{self, OrderError};

fn order_error(e: OrderError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

fn row_index(row: i64) -> PyResult<u32> {
    u32::try_from(row).map_err(|_| PyValueError::new_err(format!("row {row} is out of range")))
}

#[pyclass(module = "quillcache._native", name = "LoadOrder")]
pub struct LoadOrder {
    pub(crate) inner: load_order::LoadOrder,
}

#[pymethods]
impl LoadOrder {
    #[new]
    fn new(width: usize) -> PyResult<Self> {
        Ok(Self {
            inner: load_order::LoadOrder::new(width).map_err(order_error)?,
        })
    }

    #[getter]
    fn width(&self) -> usize {
        self.inner.width()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn set(&mut self, row: i64, values: Vec<f64>, worker: u64, rank: u32) -> PyResult<()> {
        self.inner
            .set(row_index(row)?, &values, worker, rank)
            .map_err(order_error)
    }

    /// Place every row of `rows` by the matching row of `values` (rows x width).
    fn set_many(
        &mut self,
        rows: PyReadonlyArray1<'_, i64>,
        values: PyReadonlyArray2<'_, f64>,
        workers: PyReadonlyArray1<'_, u64>,
        ranks: PyReadonlyArray1<'_, u32>,
    ) -> PyResult<()> {
        let n = rows.len();
        if values.shape() != [n, self.inner.width()] || workers.len() != n || ranks.len() != n {
            return Err(PyValueError::new_err(format!(
                "set_many wants {n} rows of {} values, {n} workers and {n} ranks; got values {:?}, \
                 {} workers, {} ranks",
                self.inner.width(),
                values.shape(),
                workers.len(),
                ranks.len()
            )));
        }
        let (rows, values, workers, ranks) = (
            rows.as_array(),
            values.as_array(),
            workers.as_array(),
            ranks.as_array(),
        );
        for i in 0..n {
            let v: Vec<f64> = values.row(i).to_vec();
            self.inner
                .set(row_index(rows[i])?, &v, workers[i], ranks[i])
                .map_err(order_error)?;
        }
        Ok(())
    }

    fn remove(&mut self, row: i64) -> PyResult<bool> {
        Ok(self.inner.remove(row_index(row)?))
    }

    fn values(&self, row: i64) -> PyResult<Option<Vec<f64>>> {
        Ok(self.inner.values(row_index(row)?))
    }

    /// Every row, from the least loaded.
    fn rows<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        let rows: Vec<i64> = self.inner.iter().map(i64::from).collect();
        PyArray1::from_vec(py, rows)
    }

    /// The positions (`position[row]`) of the first `k` rows in order whose position is
    /// at least 0: the `k` least loaded candidates of a view.
    fn first<'py>(
        &self,
        py: Python<'py>,
        k: usize,
        position: PyReadonlyArray1<'_, isize>,
    ) -> PyResult<Bound<'py, PyArray1<isize>>> {
        let position = position
            .as_slice()
            .map_err(|_| PyValueError::new_err("position must be a contiguous 1-D intp array"))?;
        let at = |row: u32| position.get(row as usize).copied().unwrap_or(-1);
        let rows = self.inner.first(k, |row| at(row) >= 0);
        Ok(PyArray1::from_vec(py, rows.into_iter().map(at).collect()))
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<LoadOrder>()
}
