//! Per-row scores of the reimplemented peer routers (`dynamo`, `llm-d`) in one pass
//! over a fleet's rows, instead of a dozen numpy operations each paying numpy's
//! per-call cost at a thousand rows.
//!
//! The Python routers' numpy expressions (`quillcache.routing.dynamo.DynamoKvCost.logits`,
//! `quillcache.routing.llmd.llmd_scores`) stay the readable reference; these functions
//! are their element-wise translation, in the same order, so the results are
//! bit-identical (`tests/routing/test_anchor_kernels.py`). As in `scoring`, numpy's
//! `maximum` propagates NaN, and integers enter float arithmetic where numpy promotes
//! them.

use crate::scoring::{maximum, RowsError, IN_FLIGHT, LOAD_WIDTH, QUEUED_PREFILL_TOKENS};

/// The load matrix's column of KV usage (`LOAD_FIELDS`).
const KV_USAGE: usize = 3;

/// A fleet's rows as the peer routers read them (view order).
#[derive(Debug, Clone, Copy)]
pub struct PeerRows<'a> {
    /// `LOAD_WIDTH` values per row.
    pub load: &'a [f64],
    /// KV capacity in blocks, per row.
    pub capacity: &'a [f64],
    pub gpu: &'a [i64],
    pub cpu: &'a [i64],
    pub disk: &'a [i64],
    pub pending: &'a [i64],
}

impl PeerRows<'_> {
    fn len(&self) -> usize {
        self.gpu.len()
    }

    fn check(&self) -> Result<(), RowsError> {
        let n = self.gpu.len();
        let lens = [
            self.load.len() / LOAD_WIDTH,
            self.capacity.len(),
            self.cpu.len(),
            self.disk.len(),
            self.pending.len(),
        ];
        if !self.load.len().is_multiple_of(LOAD_WIDTH) || lens.iter().any(|&l| l != n) {
            return Err(RowsError::Lengths(format!(
                "{n} gpu values, {} load values, capacity/cpu/disk/pending {:?}",
                self.load.len(),
                &lens[1..]
            )));
        }
        if n == 0 {
            return Err(RowsError::Empty);
        }
        Ok(())
    }

    fn field(&self, row: usize, field: usize) -> f64 {
        self.load[row * LOAD_WIDTH + field]
    }
}

/// `DynamoKvCost`'s knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamoKnobs {
    pub overlap_score_credit: f64,
    pub host_cache_hit_weight: f64,
    pub disk_cache_hit_weight: f64,
    pub prefill_load_scale: f64,
    pub overlap_score_credit_decay: f64,
    pub active_request_weight: f64,
}

/// `DynamoKvCost.logits`: every row's cost (lower is better) for a request of
/// `full_blocks` full blocks and `prompt_tokens` tokens, `block_size` tokens a block.
pub fn dynamo_costs(
    rows: &PeerRows<'_>,
    knobs: &DynamoKnobs,
    full_blocks: i64,
    prompt_tokens: i64,
    block_size: i64,
) -> Result<Vec<f64>, RowsError> {
    rows.check()?;
    if block_size <= 0 {
        return Err(RowsError::Lengths(format!("block size {block_size}")));
    }
    let n = rows.len();
    let bs = block_size as f64;
    // numpy's min: NaN if any value is NaN
    let mut min_queued = f64::INFINITY;
    for i in 0..n {
        let q = rows.field(i, QUEUED_PREFILL_TOKENS);
        if q.is_nan() || min_queued.is_nan() {
            min_queued = f64::NAN;
        } else if q < min_queued {
            min_queued = q;
        }
    }
    // max(-(-prompt // bs), 1): Python's floor division
    let request_blocks = (-((-prompt_tokens).div_euclid(block_size))).max(1) as f64;
    Ok((0..n)
        .map(|i| {
            let device = rows.gpu[i];
            let host = (rows.cpu[i] - device).max(0);
            let disk = (rows.disk[i] - device.max(rows.cpu[i])).max(0);
            let queued = rows.field(i, QUEUED_PREFILL_TOKENS);
            let mut credit = knobs.overlap_score_credit;
            if knobs.overlap_score_credit_decay > 0.0 {
                let backlog = (queued - min_queued) / bs / request_blocks;
                credit =
                    knobs.overlap_score_credit / (1.0 + knobs.overlap_score_credit_decay * backlog);
            }
            let overlap_credit = credit * device as f64
                + knobs.host_cache_hit_weight * host as f64
                + knobs.disk_cache_hit_weight * disk as f64;
            let raw_prefill = (queued + prompt_tokens as f64) / bs;
            let shared = device.max(rows.pending[i]).min(full_blocks);
            let potential_decode =
                rows.field(i, KV_USAGE) * rows.capacity[i] + (full_blocks - shared) as f64;
            knobs.prefill_load_scale * maximum(raw_prefill - overlap_credit, 0.0)
                + potential_decode
                + knobs.active_request_weight * rows.field(i, IN_FLIGHT)
        })
        .collect())
}

/// llm-d's weights: precise prefix, queue, KV utilisation; and its tier weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LlmdKnobs {
    pub prefix_weight: f64,
    pub queue_weight: f64,
    pub kv_weight: f64,
    pub gpu_tier_weight: f64,
    pub cpu_tier_weight: f64,
}

/// `llmd_scores`: every row's weighted score (higher is better).
pub fn llmd_scores(rows: &PeerRows<'_>, knobs: &LlmdKnobs) -> Result<Vec<f64>, RowsError> {
    rows.check()?;
    let n = rows.len();
    let hits: Vec<f64> = (0..n)
        .map(|i| {
            let gpu = rows.gpu[i];
            let lower = rows.cpu[i].max(rows.disk[i]) - gpu;
            knobs.gpu_tier_weight * gpu as f64 + knobs.cpu_tier_weight * lower.max(0) as f64
        })
        .collect();
    // normalised_hits: min-max over the rows with a hit (all equal: 1), 0 elsewhere
    let (mut lo, mut hi, mut any) = (f64::INFINITY, f64::NEG_INFINITY, false);
    for &h in &hits {
        if h > 0.0 {
            any = true;
            lo = lo.min(h);
            hi = hi.max(h);
        }
    }
    let (mut qlo, mut qhi) = (f64::INFINITY, f64::NEG_INFINITY);
    for i in 0..n {
        let q = rows.field(i, IN_FLIGHT);
        qlo = qlo.min(q);
        qhi = qhi.max(q);
    }
    Ok((0..n)
        .map(|i| {
            let h = hits[i];
            let prefix = if !any {
                0.0
            } else if lo == hi {
                if h > 0.0 {
                    1.0
                } else {
                    0.0
                }
            } else if h > 0.0 {
                (h - lo) / (hi - lo)
            } else {
                0.0
            };
            let queue = if qhi == qlo {
                1.0
            } else {
                (qhi - rows.field(i, IN_FLIGHT)) / (qhi - qlo)
            };
            knobs.prefix_weight * prefix
                + knobs.queue_weight * queue
                + knobs.kv_weight * (1.0 - rows.field(i, KV_USAGE))
        })
        .collect())
}

/// The three rows `SglangCacheAware.route` may choose from, found in one pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SglangPick {
    /// The row with the fewest requests in flight (then the lowest id, then the first),
    /// when the load is imbalanced; None when it is balanced.
    pub least: Option<usize>,
    /// The longest match (the GPU prefix or the blocks being computed, whichever is
    /// longer), then the fewest in flight, then the lowest id, then the first.
    pub longest: usize,
    /// The fewest resident blocks, then the fewest in flight, then the lowest id, then
    /// the first.
    pub smallest: usize,
}

/// `SglangCacheAware.route`'s candidates: `load` has `LOAD_WIDTH` values per row,
/// `resident` the resident blocks per row; the load is imbalanced when `max - min >
/// abs_threshold` and `max > min * rel_threshold` (requests in flight). Ties as
/// numpy's `first_min` breaks them. A NaN in flight or resident count is an error (the
/// comparisons would not be an order).
pub fn sglang_pick(
    load: &[f64],
    resident: &[f64],
    worker: &[u64],
    gpu: &[i64],
    pending: &[i64],
    abs_threshold: f64,
    rel_threshold: f64,
) -> Result<SglangPick, RowsError> {
    let n = gpu.len();
    let lens = [
        load.len() / LOAD_WIDTH,
        resident.len(),
        worker.len(),
        pending.len(),
    ];
    if !load.len().is_multiple_of(LOAD_WIDTH) || lens.iter().any(|&l| l != n) {
        return Err(RowsError::Lengths(format!(
            "{n} gpu values, {} load values, resident/worker/pending {:?}",
            load.len(),
            &lens[1..]
        )));
    }
    if n == 0 {
        return Err(RowsError::Empty);
    }
    let in_flight = |i: usize| load[i * LOAD_WIDTH + IN_FLIGHT];
    let held = |i: usize| gpu[i].max(pending[i]);
    let (mut lo, mut hi) = (in_flight(0), in_flight(0));
    let (mut least, mut longest, mut smallest) = (0, 0, 0);
    for i in 0..n {
        let q = in_flight(i);
        if q.is_nan() || resident[i].is_nan() {
            return Err(RowsError::Lengths(format!(
                "row {i}: requests in flight {q}, resident blocks {}: not numbers",
                resident[i]
            )));
        }
        if i == 0 {
            continue;
        }
        lo = lo.min(q);
        hi = hi.max(q);
        // (in flight, id) ascending: strictly better only, so the first of equals stays
        let lighter = |b: usize| q < in_flight(b) || (q == in_flight(b) && worker[i] < worker[b]);
        if lighter(least) {
            least = i;
        }
        let (h, hb) = (held(i), held(longest));
        if h > hb || (h == hb && lighter(longest)) {
            longest = i;
        }
        let (r, rb) = (resident[i], resident[smallest]);
        if r < rb || (r == rb && lighter(smallest)) {
            smallest = i;
        }
    }
    let imbalanced = hi - lo > abs_threshold && hi > lo * rel_threshold;
    Ok(SglangPick {
        least: imbalanced.then_some(least),
        longest,
        smallest,
    })
}

/// The positions (ascending) whose value is within `tolerance` of the best: `values[i]
/// <= min + tolerance` when `lowest`, else `values[i] >= max - tolerance`; numpy's
/// `flatnonzero(v <= v.min() + tol)` (or `>= v.max() - tol`) in one pass over the
/// values and one over the few near the best. A NaN is an error (numpy's min and max
/// propagate it, and then no position compares true).
pub fn best_positions(
    values: &[f64],
    tolerance: f64,
    lowest: bool,
) -> Result<Vec<usize>, RowsError> {
    if values.is_empty() {
        return Err(RowsError::Empty);
    }
    let mut best = values[0];
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            return Err(RowsError::Lengths(format!("value {i} is not a number")));
        }
        if (lowest && v < best) || (!lowest && v > best) {
            best = v;
        }
    }
    Ok(if lowest {
        let bound = best + tolerance;
        (0..values.len()).filter(|&i| values[i] <= bound).collect()
    } else {
        let bound = best - tolerance;
        (0..values.len()).filter(|&i| values[i] >= bound).collect()
    })
}
