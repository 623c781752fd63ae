//! `dynamo_costs`, `llmd_scores`, `sglang_pick`, `best_positions`:
//! `quillcache_core::anchor_scores` for the peer routers.

use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use quillcache_core::anchor_scores::{self, DynamoKnobs, LlmdKnobs, PeerRows};
use quillcache_core::scoring::LOAD_WIDTH;

use crate::scoring::{rows_error, slice};

/// The view's columns the peer routers read, borrowed for one call.
struct Columns<'py> {
    load: PyReadonlyArray2<'py, f64>,
    capacity: PyReadonlyArray1<'py, f64>,
    gpu: PyReadonlyArray1<'py, i64>,
    cpu: PyReadonlyArray1<'py, i64>,
    disk: PyReadonlyArray1<'py, i64>,
    pending: PyReadonlyArray1<'py, i64>,
}

impl Columns<'_> {
    fn rows(&self) -> PyResult<PeerRows<'_>> {
        if self.load.shape()[1] != LOAD_WIDTH {
            return Err(PyValueError::new_err(format!(
                "load must have {LOAD_WIDTH} columns, it has {}",
                self.load.shape()[1]
            )));
        }
        Ok(PeerRows {
            load: self.load.as_slice().map_err(|_| {
                PyValueError::new_err("load must be a C-contiguous (rows, 5) float64 array")
            })?,
            capacity: slice("capacity", &self.capacity)?,
            gpu: slice("gpu_blocks", &self.gpu)?,
            cpu: slice("cpu_blocks", &self.cpu)?,
            disk: slice("disk_blocks", &self.disk)?,
            pending: slice("pending_blocks", &self.pending)?,
        })
    }
}

/// `DynamoKvCost.logits` per row, bit for bit.
#[pyfunction]
#[pyo3(signature = (
    load, capacity, gpu, cpu, disk, pending, full_blocks, prompt_tokens, block_size, *,
    overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight, prefill_load_scale,
    overlap_score_credit_decay, active_request_weight
))]
#[allow(clippy::too_many_arguments)]
fn dynamo_costs<'py>(
    py: Python<'py>,
    load: PyReadonlyArray2<'py, f64>,
    capacity: PyReadonlyArray1<'py, f64>,
    gpu: PyReadonlyArray1<'py, i64>,
    cpu: PyReadonlyArray1<'py, i64>,
    disk: PyReadonlyArray1<'py, i64>,
    pending: PyReadonlyArray1<'py, i64>,
    full_blocks: i64,
    prompt_tokens: i64,
    block_size: i64,
    overlap_score_credit: f64,
    host_cache_hit_weight: f64,
    disk_cache_hit_weight: f64,
    prefill_load_scale: f64,
    overlap_score_credit_decay: f64,
    active_request_weight: f64,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let columns = Columns {
        load,
        capacity,
        gpu,
        cpu,
        disk,
        pending,
    };
    let knobs = DynamoKnobs {
        overlap_score_credit,
        host_cache_hit_weight,
        disk_cache_hit_weight,
        prefill_load_scale,
        overlap_score_credit_decay,
        active_request_weight,
    };
    let costs = anchor_scores::dynamo_costs(
        &columns.rows()?,
        &knobs,
        full_blocks,
        prompt_tokens,
        block_size,
    )
    .map_err(rows_error)?;
    Ok(PyArray1::from_vec(py, costs))
}

/// `llmd_scores` per row, bit for bit.
#[pyfunction]
#[pyo3(signature = (
    load, capacity, gpu, cpu, disk, pending, *, prefix_weight, queue_weight, kv_weight,
    gpu_tier_weight, cpu_tier_weight
))]
#[allow(clippy::too_many_arguments)]
fn llmd_scores<'py>(
    py: Python<'py>,
    load: PyReadonlyArray2<'py, f64>,
    capacity: PyReadonlyArray1<'py, f64>,
    gpu: PyReadonlyArray1<'py, i64>,
    cpu: PyReadonlyArray1<'py, i64>,
    disk: PyReadonlyArray1<'py, i64>,
    pending: PyReadonlyArray1<'py, i64>,
    prefix_weight: f64,
    queue_weight: f64,
    kv_weight: f64,
    gpu_tier_weight: f64,
    cpu_tier_weight: f64,
) -> PyResult<Bound<'py, PyArray1<f64>>> {
    let columns = Columns {
        load,
        capacity,
        gpu,
        cpu,
        disk,
        pending,
    };
    let knobs = LlmdKnobs {
        prefix_weight,
        queue_weight,
        kv_weight,
        gpu_tier_weight,
        cpu_tier_weight,
    };
    let scores = anchor_scores::llmd_scores(&columns.rows()?, &knobs).map_err(rows_error)?;
    Ok(PyArray1::from_vec(py, scores))
}

/// `SglangCacheAware.route`'s candidate rows: `(least, longest, smallest)` positions,
/// `least` -1 when the load is balanced (`anchor_scores::sglang_pick`).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn sglang_pick(
    load: PyReadonlyArray2<'_, f64>,
    fleet: PyReadonlyArray2<'_, f64>,
    worker: PyReadonlyArray1<'_, u64>,
    gpu: PyReadonlyArray1<'_, i64>,
    pending: PyReadonlyArray1<'_, i64>,
    abs_threshold: f64,
    rel_threshold: f64,
) -> PyResult<(isize, usize, usize)> {
    if load.shape()[1] != LOAD_WIDTH {
        return Err(PyValueError::new_err(format!(
            "load must have {LOAD_WIDTH} columns, it has {}",
            load.shape()[1]
        )));
    }
    let load_rows = load.as_slice().map_err(|_| {
        PyValueError::new_err("load must be a C-contiguous (rows, 5) float64 array")
    })?;
    let width = fleet.shape()[1];
    if width < 2 {
        return Err(PyValueError::new_err(format!(
            "fleet must have its resident blocks in column 1; it has {width} columns"
        )));
    }
    let fleet_rows = fleet
        .as_slice()
        .map_err(|_| PyValueError::new_err("fleet must be a C-contiguous float64 array"))?;
    let resident: Vec<f64> = fleet_rows.chunks_exact(width).map(|r| r[1]).collect();
    let pick = anchor_scores::sglang_pick(
        load_rows,
        &resident,
        slice("worker", &worker)?,
        slice("gpu_blocks", &gpu)?,
        slice("pending_blocks", &pending)?,
        abs_threshold,
        rel_threshold,
    )
    .map_err(rows_error)?;
    let least = pick.least.map_or(-1, |l| l as isize);
    Ok((least, pick.longest, pick.smallest))
}

/// The positions within `tolerance` of the lowest (`lowest`) or highest value
/// (`anchor_scores::best_positions`).
#[pyfunction]
#[pyo3(signature = (values, tolerance=0.0, lowest=true))]
fn best_positions(
    values: PyReadonlyArray1<'_, f64>,
    tolerance: f64,
    lowest: bool,
) -> PyResult<Vec<usize>> {
    anchor_scores::best_positions(slice("values", &values)?, tolerance, lowest).map_err(rows_error)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(best_positions, m)?)?;
    m.add_function(wrap_pyfunction!(dynamo_costs, m)?)?;
    m.add_function(wrap_pyfunction!(llmd_scores, m)?)?;
    m.add_function(wrap_pyfunction!(sglang_pick, m)?)
}
