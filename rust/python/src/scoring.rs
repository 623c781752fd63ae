//! `CostKernel`: `quillcache_core::scoring` for the cost-model routers. Converts the
//! view's columns (numpy, contiguous) into slices and the result back into numpy.

use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::load_order::LoadOrder;
use quillcache_core::scoring::{self, Ask, CostParams, QuillKnobs, RowTerms, Rows, RowsError};
use quillcache_core::shortlist;

/// A shortlist's rows: view positions, requests, pending requests.
type Preferences = (Vec<usize>, Vec<f64>, Vec<f64>);
/// A shortlist in load units: workers, ranks, ceilings, credits, held blocks, outside.
type LoadUnits = (
    Vec<u64>,
    Vec<i64>,
    Vec<f64>,
    Vec<f64>,
    Vec<i64>,
    Option<(f64, f64)>,
);

pub(crate) fn slice<'a, T: numpy::Element>(
    what: &str,
    array: &'a PyReadonlyArray1<'_, T>,
) -> PyResult<&'a [T]> {
    array
        .as_slice()
        .map_err(|_| PyValueError::new_err(format!("{what} must be a contiguous 1-D array")))
}

/// A walk's arguments: the special positions, and the order's rows as view positions
/// (`position[row]`; negative: not a candidate).
fn walk_args<'a>(
    order: &'a LoadOrder,
    position: &'a [isize],
    special: &PyReadonlyArray1<'_, isize>,
) -> PyResult<(Vec<usize>, impl Iterator<Item = usize> + 'a)> {
    let special: Vec<usize> = slice("special", special)?
        .iter()
        .map(|&i| usize::try_from(i).map_err(|_| PyValueError::new_err(format!("position {i}"))))
        .collect::<PyResult<_>>()?;
    if order.inner.width() != 1 {
        return Err(PyValueError::new_err(
            "order must be by one value (queued prefill tokens)",
        ));
    }
    let by_queue = order.inner.iter().filter_map(move |row| {
        let at = position.get(row as usize).copied().unwrap_or(-1);
        usize::try_from(at).ok()
    });
    Ok((special, by_queue))
}

/// `quill`'s per-row terms, borrowed for one call.
fn row_terms<'a>(
    session_kv_tokens: &'a Option<PyReadonlyArray1<'_, f64>>,
    pace: &'a Option<PyReadonlyArray1<'_, f64>>,
    slots: &'a Option<PyReadonlyArray1<'_, f64>>,
    fleet: &'a Option<PyReadonlyArray2<'_, f64>>,
) -> PyResult<RowTerms<'a>> {
    let fleet =
        match fleet {
            Some(f) => {
                if f.shape()[1] != scoring::FLEET_WIDTH {
                    return Err(PyValueError::new_err(format!(
                        "fleet must have {} columns, it has {}",
                        scoring::FLEET_WIDTH,
                        f.shape()[1]
                    )));
                }
                Some(f.as_slice().map_err(|_| {
                    PyValueError::new_err("fleet must be a C-contiguous float64 array")
                })?)
            }
            None => None,
        };
    let slots = slots.as_ref().map(|s| slice("slots", s)).transpose()?;
    if let Some(bad) = slots.and_then(|s| s.iter().find(|&&x| !(x == 0.0 || x >= 1.0))) {
        return Err(PyValueError::new_err(format!(
            "slots must be 0 (the cost model's max_num_seqs) or at least 1, got {bad}"
        )));
    }
    Ok(RowTerms {
        session_kv_tokens: session_kv_tokens
            .as_ref()
            .map(|b| slice("session_kv_tokens", b))
            .transpose()?,
        pace: pace.as_ref().map(|p| slice("pace", p)).transpose()?,
        slots,
        fleet,
    })
}

pub(crate) fn rows_error(e: RowsError) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// The load matrix's values, row-major, `LOAD_WIDTH` per row.
fn load_values<'a>(load: &'a PyReadonlyArray2<'_, f64>) -> PyResult<&'a [f64]> {
    if load.shape()[1] != scoring::LOAD_WIDTH {
        return Err(PyValueError::new_err(format!(
            "load must have {} columns, it has {}",
            scoring::LOAD_WIDTH,
            load.shape()[1]
        )));
    }
    load.as_slice()
        .map_err(|_| PyValueError::new_err("load must be a C-contiguous (rows, 5) float64 array"))
}

/// The view's columns, borrowed for one call.
struct Columns<'py> {
    worker: PyReadonlyArray1<'py, u64>,
    load: PyReadonlyArray2<'py, f64>,
    gpu: PyReadonlyArray1<'py, i64>,
    cpu: PyReadonlyArray1<'py, i64>,
    disk: PyReadonlyArray1<'py, i64>,
    pending: PyReadonlyArray1<'py, i64>,
}

impl Columns<'_> {
    fn rows(&self) -> PyResult<Rows<'_>> {
        let load = load_values(&self.load)?;
        Ok(Rows {
            worker: slice("worker", &self.worker)?,
            load,
            gpu: slice("gpu_blocks", &self.gpu)?,
            cpu: slice("cpu_blocks", &self.cpu)?,
            disk: slice("disk_blocks", &self.disk)?,
            pending: slice("pending_blocks", &self.pending)?,
        })
    }
}

#[pyclass(module = "quillcache._native", name = "CostKernel", frozen)]
pub struct CostKernel {
    params: CostParams,
}

#[pymethods]
impl CostKernel {
    #[new]
    #[pyo3(signature = (
        *, linear_flops_per_token, attn_flops_per_pair, flops_per_s, overhead_s,
        weight_read_s, kv_read_s_per_token, chunk_budget, block_size, kv_bytes_per_token,
        transfer_latency_s, cpu_gbps, disk_gbps, peer_gbps, allow_peer_fetch, max_num_seqs
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        linear_flops_per_token: f64,
        attn_flops_per_pair: f64,
        flops_per_s: f64,
        overhead_s: f64,
        weight_read_s: f64,
        kv_read_s_per_token: f64,
        chunk_budget: i64,
        block_size: i64,
        kv_bytes_per_token: i64,
        transfer_latency_s: f64,
        cpu_gbps: f64,
        disk_gbps: f64,
        peer_gbps: f64,
        allow_peer_fetch: bool,
        max_num_seqs: i64,
    ) -> PyResult<Self> {
        if chunk_budget <= 0 {
            return Err(PyValueError::new_err("chunk_budget must be positive"));
        }
        if max_num_seqs <= 0 {
            return Err(PyValueError::new_err("max_num_seqs must be positive"));
        }
        Ok(Self {
            params: CostParams {
                linear_flops_per_token,
                attn_flops_per_pair,
                flops_per_s,
                overhead_s,
                weight_read_s,
                kv_read_s_per_token,
                chunk_budget,
                block_size,
                kv_bytes_per_token,
                transfer_latency_s,
                cpu_gbps,
                disk_gbps,
                peer_gbps,
                allow_peer_fetch,
                max_num_seqs,
            },
        })
    }

    /// `cost_preferences` (`quillcache_core::shortlist`): the shortlist of a router that
    /// picks the lowest `scores`, as `(positions, requests, pending_requests)`; None
    /// when a score is NaN (the reference then orders them as numpy does).
    #[pyo3(signature = (
        scores, scores_if_held, gpu, pending, position, size, prompt_tokens, blocks, block_size
    ))]
    #[allow(clippy::too_many_arguments)]
    fn cost_preferences(
        &self,
        scores: PyReadonlyArray1<'_, f64>,
        scores_if_held: Option<PyReadonlyArray1<'_, f64>>,
        gpu: PyReadonlyArray1<'_, i64>,
        pending: PyReadonlyArray1<'_, i64>,
        position: usize,
        size: usize,
        prompt_tokens: i64,
        blocks: i64,
        block_size: i64,
    ) -> PyResult<Option<Preferences>> {
        let held = match &scores_if_held {
            Some(h) => Some(slice("scores_if_held", h)?),
            None => None,
        };
        let ask = shortlist::Ask {
            prompt_tokens,
            blocks,
            block_size,
        };
        match shortlist::cost_preferences(
            &self.params,
            slice("scores", &scores)?,
            held,
            &shortlist::Held {
                gpu: slice("gpu", &gpu)?,
                pending: slice("pending", &pending)?,
            },
            position,
            size,
            &ask,
        ) {
            Ok(prefs) => Ok(Some((
                prefs.iter().map(|p| p.position).collect(),
                prefs.iter().map(|p| p.requests).collect(),
                prefs.iter().map(|p| p.pending_requests).collect(),
            ))),
            Err(shortlist::ShortlistError::NotANumber) => Ok(None),
            Err(e) => Err(PyValueError::new_err(e.to_string())),
        }
    }

    /// `shortlist_of` (`quillcache_core::shortlist::load_units`): the preferences
    /// `positions`, `requests`, `pending_requests` of a view's rows in the booking's
    /// load units, as `(workers, ranks, ceilings, credits, held blocks, outside)`,
    /// `outside` the first row's (ceiling, credit) holding none of the prefix.
    #[pyo3(signature = (
        worker, rank, load, gpu, cpu, disk, pending, positions, requests, pending_requests,
        weights, prompt_tokens, blocks, block_size
    ))]
    #[allow(clippy::too_many_arguments)]
    fn load_units(
        &self,
        worker: PyReadonlyArray1<'_, u64>,
        rank: PyReadonlyArray1<'_, i64>,
        load: PyReadonlyArray2<'_, f64>,
        gpu: PyReadonlyArray1<'_, i64>,
        cpu: PyReadonlyArray1<'_, i64>,
        disk: PyReadonlyArray1<'_, i64>,
        pending: PyReadonlyArray1<'_, i64>,
        positions: Vec<usize>,
        requests: Vec<f64>,
        pending_requests: Vec<f64>,
        weights: (f64, f64, f64),
        prompt_tokens: i64,
        blocks: i64,
        block_size: i64,
    ) -> PyResult<LoadUnits> {
        if requests.len() != positions.len() || pending_requests.len() != positions.len() {
            return Err(PyValueError::new_err(format!(
                "{} positions, {} requests, {} pending requests",
                positions.len(),
                requests.len(),
                pending_requests.len()
            )));
        }
        let preferences: Vec<shortlist::Preference> = positions
            .iter()
            .zip(&requests)
            .zip(&pending_requests)
            .map(
                |((&position, &requests), &pending_requests)| shortlist::Preference {
                    position,
                    requests,
                    pending_requests,
                },
            )
            .collect();
        let columns = shortlist::Columns {
            worker: slice("worker", &worker)?,
            rank: slice("rank", &rank)?,
            load: load_values(&load)?,
            gpu: slice("gpu", &gpu)?,
            cpu: slice("cpu", &cpu)?,
            disk: slice("disk", &disk)?,
            pending: slice("pending", &pending)?,
        };
        let w = shortlist::Weights {
            in_flight: weights.0,
            queued_tokens: weights.1,
            decodes: weights.2,
        };
        let ask = shortlist::Ask {
            prompt_tokens,
            blocks,
            block_size,
        };
        let (units, outside) = shortlist::load_units(&columns, &preferences, &w, &ask)
            .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok((
            units.iter().map(|u| u.worker).collect(),
            units.iter().map(|u| u.rank).collect(),
            units.iter().map(|u| u.ceiling).collect(),
            units.iter().map(|u| u.credit).collect(),
            units.iter().map(|u| u.held).collect(),
            outside,
        ))
    }

    /// `(running decodes, requests waiting)` over the rows of `load`, summed in row
    /// order (waiting: in flight minus running decodes, at least 0).
    fn load_sums(&self, load: PyReadonlyArray2<'_, f64>) -> PyResult<(f64, f64)> {
        let values = load_values(&load)?;
        Ok(scoring::load_sums(values))
    }

    /// `(position, estimates)`: `estimate_ttft_s_array` per row, and the row with the
    /// lowest estimate (then the longest local prefix, fewest in flight, lowest id).
    #[pyo3(signature = (worker, load, gpu, cpu, disk, pending, blocks, prompt_tokens, block_size))]
    #[allow(clippy::too_many_arguments)]
    fn ttft<'py>(
        &self,
        py: Python<'py>,
        worker: PyReadonlyArray1<'py, u64>,
        load: PyReadonlyArray2<'py, f64>,
        gpu: PyReadonlyArray1<'py, i64>,
        cpu: PyReadonlyArray1<'py, i64>,
        disk: PyReadonlyArray1<'py, i64>,
        pending: PyReadonlyArray1<'py, i64>,
        blocks: i64,
        prompt_tokens: i64,
        block_size: i64,
    ) -> PyResult<(usize, Bound<'py, PyArray1<f64>>)> {
        let columns = Columns {
            worker,
            load,
            gpu,
            cpu,
            disk,
            pending,
        };
        let rows = columns.rows()?;
        let ask = Ask {
            blocks,
            prompt_tokens,
            block_size,
        };
        let estimates = scoring::ttft_estimates(&self.params, &rows, &ask).map_err(rows_error)?;
        let at = scoring::lowest(&estimates, &rows, false).map_err(rows_error)?;
        Ok((at, PyArray1::from_vec(py, estimates)))
    }

    /// `ttft`'s winning position without scoring every row (`ttft_lowest_walk`): the
    /// rows in `special`, then the rest in `order` (by queued prefill tokens;
    /// `position[row]`: the row's position in the view, negative when not a candidate)
    /// until no row left can win. None: score every row with `ttft`.
    #[pyo3(signature = (
        order, position, special, worker, load, gpu, cpu, disk, pending, blocks,
        prompt_tokens, block_size
    ))]
    #[allow(clippy::too_many_arguments)]
    fn ttft_lowest<'py>(
        &self,
        order: PyRef<'py, LoadOrder>,
        position: PyReadonlyArray1<'py, isize>,
        special: PyReadonlyArray1<'py, isize>,
        worker: PyReadonlyArray1<'py, u64>,
        load: PyReadonlyArray2<'py, f64>,
        gpu: PyReadonlyArray1<'py, i64>,
        cpu: PyReadonlyArray1<'py, i64>,
        disk: PyReadonlyArray1<'py, i64>,
        pending: PyReadonlyArray1<'py, i64>,
        blocks: i64,
        prompt_tokens: i64,
        block_size: i64,
    ) -> PyResult<Option<usize>> {
        let columns = Columns {
            worker,
            load,
            gpu,
            cpu,
            disk,
            pending,
        };
        let rows = columns.rows()?;
        let ask = Ask {
            blocks,
            prompt_tokens,
            block_size,
        };
        let position = slice("position", &position)?;
        let (special, by_queue) = walk_args(&order, position, &special)?;
        scoring::ttft_lowest_walk(&self.params, &rows, &ask, &special, by_queue).map_err(rows_error)
    }

    /// `(position, estimates)`: `QuillCacheRouter.estimates` per row, and the row with
    /// the lowest (then the longest prefix held or being computed, fewest in flight,
    /// lowest id). `session_kv_tokens`: per row, the KV tokens a new session's home's
    /// decodes read each step.
    #[pyo3(signature = (
        worker, load, gpu, cpu, disk, pending, blocks, prompt_tokens, block_size, settings,
        lambda_, continuing, mean_decodes, expected_output_tokens, session_kv_tokens, pace, slots=None,
        fleet=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn quill<'py>(
        &self,
        py: Python<'py>,
        worker: PyReadonlyArray1<'py, u64>,
        load: PyReadonlyArray2<'py, f64>,
        gpu: PyReadonlyArray1<'py, i64>,
        cpu: PyReadonlyArray1<'py, i64>,
        disk: PyReadonlyArray1<'py, i64>,
        pending: PyReadonlyArray1<'py, i64>,
        blocks: i64,
        prompt_tokens: i64,
        block_size: i64,
        settings: PyRef<'py, QuillSettings>,
        lambda_: f64,
        continuing: bool,
        mean_decodes: f64,
        expected_output_tokens: i64,
        session_kv_tokens: Option<PyReadonlyArray1<'py, f64>>,
        pace: Option<PyReadonlyArray1<'py, f64>>,
        slots: Option<PyReadonlyArray1<'py, f64>>,
        fleet: Option<PyReadonlyArray2<'py, f64>>,
    ) -> PyResult<(usize, Bound<'py, PyArray1<f64>>)> {
        let columns = Columns {
            worker,
            load,
            gpu,
            cpu,
            disk,
            pending,
        };
        let rows = columns.rows()?;
        let ask = Ask {
            blocks,
            prompt_tokens,
            block_size,
        };
        let knobs = settings.knobs(lambda_, continuing, mean_decodes, expected_output_tokens);
        let terms = row_terms(&session_kv_tokens, &pace, &slots, &fleet)?;
        let estimates = scoring::quill_estimates(&self.params, &rows, &ask, &knobs, terms)
            .map_err(rows_error)?;
        let at = scoring::lowest(&estimates, &rows, true).map_err(rows_error)?;
        Ok((at, PyArray1::from_vec(py, estimates)))
    }

    /// `quill`'s winning position without scoring every row (`quill_lowest_walk`):
    /// `special` (positions of the rows above the match's floor or with pending
    /// blocks), then the rest in `order` (a `LoadOrder` by queued prefill tokens;
    /// `position[row]`: the row's position in the view, negative when not a
    /// candidate) until no row left can win. None: score every row with `quill`.
    #[pyo3(signature = (
        order, position, special, worker, load, gpu, cpu, disk, pending, blocks,
        prompt_tokens, block_size, settings, lambda_, continuing, mean_decodes,
        expected_output_tokens, session_kv_tokens, pace, slots=None, fleet=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn quill_lowest<'py>(
        &self,
        order: PyRef<'py, LoadOrder>,
        position: PyReadonlyArray1<'py, isize>,
        special: PyReadonlyArray1<'py, isize>,
        worker: PyReadonlyArray1<'py, u64>,
        load: PyReadonlyArray2<'py, f64>,
        gpu: PyReadonlyArray1<'py, i64>,
        cpu: PyReadonlyArray1<'py, i64>,
        disk: PyReadonlyArray1<'py, i64>,
        pending: PyReadonlyArray1<'py, i64>,
        blocks: i64,
        prompt_tokens: i64,
        block_size: i64,
        settings: PyRef<'py, QuillSettings>,
        lambda_: f64,
        continuing: bool,
        mean_decodes: f64,
        expected_output_tokens: i64,
        session_kv_tokens: Option<PyReadonlyArray1<'py, f64>>,
        pace: Option<PyReadonlyArray1<'py, f64>>,
        slots: Option<PyReadonlyArray1<'py, f64>>,
        fleet: Option<PyReadonlyArray2<'py, f64>>,
    ) -> PyResult<Option<usize>> {
        let columns = Columns {
            worker,
            load,
            gpu,
            cpu,
            disk,
            pending,
        };
        let rows = columns.rows()?;
        let ask = Ask {
            blocks,
            prompt_tokens,
            block_size,
        };
        let knobs = settings.knobs(lambda_, continuing, mean_decodes, expected_output_tokens);
        let terms = row_terms(&session_kv_tokens, &pace, &slots, &fleet)?;
        let position = slice("position", &position)?;
        let (special, by_queue) = walk_args(&order, position, &special)?;
        scoring::quill_lowest_walk(&self.params, &rows, &ask, &knobs, terms, &special, by_queue)
            .map_err(rows_error)
    }
}

/// `QuillCacheRouter`'s knobs, fixed when the router is made: given to every `quill`
/// call as one object rather than as a dozen keyword arguments per request.
#[pyclass(module = "quillcache._native", name = "QuillSettings", frozen)]
pub struct QuillSettings {
    speculative: bool,
    interference: bool,
    work_weight: f64,
    per_worker_lambda: bool,
    work_base: f64,
    max_work_weight: f64,
    continuing_work_weight: f64,
    decode_weight: f64,
    home_decode_weight: f64,
    evict_weight: f64,
}

impl QuillSettings {
    fn knobs(
        &self,
        lambda: f64,
        continuing: bool,
        mean_decodes: f64,
        expected_output_tokens: i64,
    ) -> QuillKnobs {
        QuillKnobs {
            speculative: self.speculative,
            interference: self.interference,
            work_weight: self.work_weight,
            lambda,
            per_worker_lambda: self.per_worker_lambda,
            work_base: self.work_base,
            max_work_weight: self.max_work_weight,
            continuing,
            continuing_work_weight: self.continuing_work_weight,
            decode_weight: self.decode_weight,
            mean_decodes,
            home_decode_weight: self.home_decode_weight,
            expected_output_tokens,
            evict_weight: self.evict_weight,
        }
    }
}

#[pymethods]
impl QuillSettings {
    #[new]
    #[pyo3(signature = (
        *, speculative, interference, work_weight, per_worker_lambda, work_base,
        max_work_weight, continuing_work_weight, decode_weight, home_decode_weight,
        evict_weight=0.0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        speculative: bool,
        interference: bool,
        work_weight: f64,
        per_worker_lambda: bool,
        work_base: f64,
        max_work_weight: f64,
        continuing_work_weight: f64,
        decode_weight: f64,
        home_decode_weight: f64,
        evict_weight: f64,
    ) -> Self {
        Self {
            speculative,
            interference,
            work_weight,
            per_worker_lambda,
            work_base,
            max_work_weight,
            continuing_work_weight,
            decode_weight,
            home_decode_weight,
            evict_weight,
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CostKernel>()?;
    m.add_class::<QuillSettings>()
}
