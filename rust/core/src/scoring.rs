//! Scoring kernels for the cost-model routers: one pass over a fleet's rows instead of
//! some fifty numpy operations, each of which costs more per call than the whole row
//! loop does.
//!
//! The Python routers' numpy expressions (`quillcache.costmodel.CostModel`'s `*_array`
//! methods, `quillcache.routing.base.estimate_ttft_s_array`,
//! `QuillCacheRouter.estimates`) stay the readable reference; every function here is
//! their element-wise translation, operation for operation and in the same order, so the
//! results are bit-identical (`tests/routing/test_kernels.py` checks it over random
//! fleets). Three numpy behaviours are reproduced on purpose: `np.maximum`/`np.minimum`
//! propagate NaN, float `//` is numpy's `npy_floor_divide`, and integers enter float
//! arithmetic converted to `f64` at the operation where numpy promotes them.

/// Columns of a row of the load matrix (`quillcache.routing.types.LOAD_FIELDS`).
pub const IN_FLIGHT: usize = 0;
pub const QUEUED_PREFILL_TOKENS: usize = 1;
pub const RUNNING_DECODES: usize = 2;
pub const MEAN_CONTEXT_TOKENS: usize = 4;
pub const QUEUED_PREFILL_PAIRS: usize = 5;
/// Fields per row of the load matrix.
pub const LOAD_WIDTH: usize = 6;
/// Columns of the fleet matrix (`quillcache.routing.types.FLEET_FIELDS`), in order.
pub const CAPACITY_BLOCKS: usize = 0;
pub const RESIDENT_BLOCKS: usize = 1;
pub const RESIDENCY_KNOWN: usize = 2;
/// Fields per row of the fleet matrix.
pub const FLEET_WIDTH: usize = 5;

/// The constants `CostModel` derives from its configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    pub linear_flops_per_token: f64,
    pub attn_flops_per_pair: f64,
    pub flops_per_s: f64,
    pub overhead_s: f64,
    pub weight_read_s: f64,
    pub kv_read_s_per_token: f64,
    /// The engine's chunked-prefill token budget per step.
    pub chunk_budget: i64,
    /// The engine's block size, for the bytes a transfer moves.
    pub block_size: i64,
    pub kv_bytes_per_token: i64,
    pub transfer_latency_s: f64,
    pub cpu_gbps: f64,
    pub disk_gbps: f64,
    pub peer_gbps: f64,
    pub allow_peer_fetch: bool,
    /// The engine's sequence slots (`max_num_seqs`): a request waits for one.
    pub max_num_seqs: i64,
}

/// A fleet's rows, in view order: ids, the load matrix (`LOAD_WIDTH` per row, row-major)
/// and the longest prefix of the request per tier, plus the blocks being computed.
#[derive(Debug, Clone, Copy)]
pub struct Rows<'a> {
    pub worker: &'a [u64],
    pub load: &'a [f64],
    pub gpu: &'a [i64],
    pub cpu: &'a [i64],
    pub disk: &'a [i64],
    pub pending: &'a [i64],
}

/// Why `Rows` cannot be scored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowsError {
    #[error("the columns disagree on the number of rows: {0}")]
    Lengths(String),
    #[error("there are no rows to choose from")]
    Empty,
}

impl Rows<'_> {
    pub fn len(&self) -> usize {
        self.worker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.worker.is_empty()
    }

    fn check(&self, session_kv_tokens: Option<&[f64]>) -> Result<(), RowsError> {
        let n = self.worker.len();
        let lens = [
            self.load.len() / LOAD_WIDTH,
            self.gpu.len(),
            self.cpu.len(),
            self.disk.len(),
            self.pending.len(),
            session_kv_tokens.map_or(n, <[f64]>::len),
        ];
        if !self.load.len().is_multiple_of(LOAD_WIDTH) || lens.iter().any(|&l| l != n) {
            return Err(RowsError::Lengths(format!(
                "{n} ids, {} load values, tiers/pending/batch {:?}",
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

    fn local(&self, row: usize) -> i64 {
        self.gpu[row].max(self.cpu[row]).max(self.disk[row])
    }
}

/// What the estimates need of the request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ask {
    /// Its blocks (`len(request.content_keys)`).
    pub blocks: i64,
    pub prompt_tokens: i64,
    /// The view's block size (tokens per block of the index).
    pub block_size: i64,
}

/// `QuillCacheRouter`'s knobs and the per-request state its `route` sets before scoring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuillKnobs {
    pub speculative: bool,
    pub interference: bool,
    /// 0: the work term is off.
    pub work_weight: f64,
    /// The request's work weight (`_lambda`) when it is one number for the fleet.
    pub lambda: f64,
    /// `adaptive and work_scope == "worker"`: the weight is per row, from its queue.
    pub per_worker_lambda: bool,
    pub work_base: f64,
    pub max_work_weight: f64,
    /// A session seen within the TTL.
    pub continuing: bool,
    pub continuing_work_weight: f64,
    /// 0: no decode pile-up term.
    pub decode_weight: f64,
    pub mean_decodes: f64,
    pub home_decode_weight: f64,
    pub expected_output_tokens: i64,
    /// The chance that a cached block a choice evicts would have been reused: its
    /// recompute, at that chance, is added for every block the request places beyond
    /// the engine's free blocks (0: no eviction term).
    pub evict_weight: f64,
}

/// `np.maximum` on floats: NaN wins.
pub(crate) fn maximum(a: f64, b: f64) -> f64 {
    if a >= b || a.is_nan() {
        a
    } else {
        b
    }
}

/// `np.minimum` on floats: NaN wins.
fn minimum(a: f64, b: f64) -> f64 {
    if a <= b || a.is_nan() {
        a
    } else {
        b
    }
}

/// Below this, integers and their quotients' floors are exact in `f64` division.
const EXACT_INTEGERS: f64 = 4_503_599_627_370_496.0; // 2**52

/// `x` (|x| < 2**52) has no fraction. The integer round trip, because `fract`, `floor`
/// and `trunc` are calls into libm on the baseline x86-64 target (no SSE4.1).
fn is_integer(x: f64) -> bool {
    (x as i64) as f64 == x
}

/// `x.floor()` for |x| < 2**52, signed zero kept (see `is_integer`).
fn floor(x: f64) -> f64 {
    if x == 0.0 {
        return x;
    }
    let t = (x as i64) as f64; // towards zero
    if t > x {
        t - 1.0
    } else {
        t
    }
}

/// `x.trunc()`, signed zero kept (see `is_integer`).
fn trunc(x: f64) -> f64 {
    if x == 0.0 || x.abs() >= EXACT_INTEGERS || x.is_nan() {
        return x.trunc();
    }
    let t = (x as i64) as f64;
    if t == 0.0 {
        0.0f64.copysign(x)
    } else {
        t
    }
}

/// numpy's float `a // b` (`npy_floor_divide`, by way of `npy_divmod`).
fn floor_divide(a: f64, b: f64) -> f64 {
    // Loads are token counts: integer-valued a and b > 0 with |a| < 2**52. Then a / b
    // rounds by less than a / b * 2**-53 < 1 / (2b), less than the distance 1 / b from
    // a non-integer quotient to the next integer, so its floor is the exact floor,
    // which is what numpy's fmod-based algorithm returns for integers (signed zero
    // included: -0.0 / b floors to -0.0 both ways). `fmod` is the slow part of a row.
    if b > 0.0 && a.abs() < EXACT_INTEGERS && is_integer(a) && b < EXACT_INTEGERS && is_integer(b) {
        return floor(a / b);
    }
    floor_divide_fmod(a, b)
}

/// `npy_floor_divide` as numpy writes it.
fn floor_divide_fmod(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        return a / b;
    }
    let rem = a % b;
    let mut div = (a - rem) / b;
    if rem != 0.0 && ((b < 0.0) != (rem < 0.0)) {
        div -= 1.0;
    }
    if div != 0.0 {
        let mut floor = div.floor();
        if div - floor > 0.5 {
            floor += 1.0;
        }
        floor
    } else {
        0.0f64.copysign(a / b)
    }
}

impl CostParams {
    /// `prefill_compute_s_array` for one row (`new` and `context` as floats).
    fn prefill_compute_s(&self, new: f64, context: f64) -> f64 {
        let pairs = new * (context + (new + 1.0) / 2.0);
        let flops = self.linear_flops_per_token * new + self.attn_flops_per_pair * pairs;
        if new <= 0.0 {
            0.0
        } else {
            flops / self.flops_per_s
        }
    }

    /// `queued_compute_s_array` for one row: every queued token attends at least to
    /// itself, so fewer pairs than tokens count as that many.
    fn queued_compute_s(&self, queued: f64, pairs: f64) -> f64 {
        let pairs = maximum(pairs, queued);
        let flops = self.linear_flops_per_token * queued + self.attn_flops_per_pair * pairs;
        if queued <= 0.0 {
            0.0
        } else {
            flops / self.flops_per_s
        }
    }

    pub(crate) fn queue_time(&self, queued: f64, pairs: f64) -> f64 {
        let steps = -floor_divide(-queued, self.chunk_budget as f64);
        let t = self.queued_compute_s(queued, pairs) + steps * self.overhead_s;
        if queued <= 0.0 {
            0.0
        } else {
            t
        }
    }

    fn prefill_time(&self, new: i64, context: i64) -> f64 {
        let steps = -((-new).div_euclid(self.chunk_budget)) as f64;
        let t = steps * self.overhead_s
            + maximum(
                self.prefill_compute_s(new as f64, context as f64),
                steps * self.weight_read_s,
            );
        if new <= 0 {
            0.0
        } else {
            t
        }
    }

    /// `loaded_prefill_time_array` for one row; `new_compute` is the row's
    /// `prefill_compute_s(new, context)` (`new` at least 1), which the caller has.
    fn loaded_prefill_time(
        &self,
        queued: f64,
        pairs: f64,
        new: i64,
        new_compute: f64,
        decodes: f64,
        mean_context: f64,
    ) -> f64 {
        let new = new.max(1);
        let total = queued + new as f64;
        let budget = maximum(self.chunk_budget as f64 - decodes, 1.0);
        let steps = -floor_divide(-total, budget);
        let compute = self.queued_compute_s(queued, pairs) + new_compute;
        let per_step = self.overhead_s + decodes * mean_context * self.kv_read_s_per_token;
        steps * per_step + maximum(compute, steps * self.weight_read_s)
    }

    fn transfer_time(&self, blocks: i64, gbps: f64) -> f64 {
        let bytes = blocks * self.block_size * self.kv_bytes_per_token;
        if blocks <= 0 {
            0.0
        } else {
            self.transfer_latency_s + bytes as f64 / (gbps * 1e9)
        }
    }

    /// `CostModel.slot_wait_time_array` for one row: with `in_flight` requests on an
    /// engine running at most `slots` sequences (0: `max_num_seqs`), a new one waits
    /// for `ceil((in_flight - slots + 1) / slots)` rounds of `out` decode steps of a
    /// full batch; 0 while a slot is free.
    fn slot_wait(
        &self,
        in_flight: f64,
        decodes: f64,
        mean_context: f64,
        out: f64,
        slots: f64,
    ) -> f64 {
        let slots = if slots > 0.0 {
            slots
        } else {
            self.max_num_seqs as f64
        };
        let over = in_flight - slots + 1.0;
        if over <= 0.0 {
            return 0.0;
        }
        let rounds = (over / slots).ceil();
        let batch = minimum(maximum(decodes, 1.0), slots);
        rounds * out * self.decode_step_time(batch, mean_context)
    }

    fn decode_step_time(&self, batch: f64, mean_context: f64) -> f64 {
        let context = trunc(batch * mean_context);
        let fixed = self.overhead_s
            + if self.weight_read_s > 0.0 {
                self.weight_read_s
            } else {
                0.0
            };
        if batch <= 0.0 {
            0.0
        } else {
            fixed + context * self.kv_read_s_per_token
        }
    }

    /// `covered_array` for one row: the blocks it serves without recomputing, given its
    /// usable GPU prefix, and the transfer time that takes.
    fn covered(&self, rows: &Rows<'_>, ask: &Ask, row: usize, gpu: i64, peer: i64) -> (i64, f64) {
        let n = ask.blocks;
        let mut covered = gpu;
        let mut transfer = 0.0;
        for (blocks, gbps) in [
            (rows.cpu[row], self.cpu_gbps),
            (rows.disk[row], self.disk_gbps),
        ] {
            let blocks = blocks.min(n);
            if blocks > covered {
                transfer += self.transfer_time(blocks - covered, gbps);
                covered = blocks;
            }
        }
        if self.allow_peer_fetch {
            let peer = peer.min(n);
            if peer > covered {
                let peer_s = self.transfer_time(peer - covered, self.peer_gbps);
                let bs = ask.block_size;
                if peer_s < self.prefill_time((peer - covered) * bs, covered * bs) {
                    transfer += peer_s;
                    covered = peer;
                }
            }
        }
        (covered, transfer)
    }
}

/// `peer_blocks_array`: per row, the longest GPU prefix another engine holds (the
/// leader's own rows see the best of the others).
fn peer_blocks(rows: &Rows<'_>) -> Vec<i64> {
    let n = rows.len();
    if n < 2 {
        return vec![0; n];
    }
    let mut first = 0;
    for (i, &g) in rows.gpu.iter().enumerate() {
        if g > rows.gpu[first] {
            first = i;
        }
    }
    let leader = rows.worker[first];
    let elsewhere = (0..n)
        .map(|i| {
            if rows.worker[i] == leader {
                0
            } else {
                rows.gpu[i]
            }
        })
        .max()
        .unwrap_or(0);
    (0..n)
        .map(|i| {
            if rows.worker[i] == leader {
                elsewhere
            } else {
                rows.gpu[first]
            }
        })
        .collect()
}

/// The last value of a function of a row's new tokens: most rows of a fleet hold the
/// same prefix of a request (the floor every engine holds), so they compute the same
/// number of new tokens, and its prefill estimate once.
struct ByNewTokens {
    last: Option<(i64, f64)>,
}

impl ByNewTokens {
    fn new() -> Self {
        Self { last: None }
    }

    fn get(&mut self, new: i64, f: impl FnOnce(i64) -> f64) -> f64 {
        match self.last {
            Some((n, value)) if n == new => value,
            _ => {
                let value = f(new);
                self.last = Some((new, value));
                value
            }
        }
    }
}

fn new_tokens(ask: &Ask, covered: i64) -> i64 {
    (ask.prompt_tokens - (covered * ask.block_size).min(ask.prompt_tokens)).max(1)
}

/// `estimate_ttft_s_array`: queue + transfer + prefill per row.
pub fn ttft_estimates(
    params: &CostParams,
    rows: &Rows<'_>,
    ask: &Ask,
) -> Result<Vec<f64>, RowsError> {
    rows.check(None)?;
    let peers = if params.allow_peer_fetch {
        peer_blocks(rows)
    } else {
        Vec::new()
    };
    let mut prefill = ByNewTokens::new();
    Ok((0..rows.len())
        .map(|i| {
            let gpu = rows.gpu[i].min(ask.blocks);
            let (covered, transfer) =
                params.covered(rows, ask, i, gpu, peers.get(i).copied().unwrap_or(0));
            let new = new_tokens(ask, covered);
            params.queue_time(
                rows.field(i, QUEUED_PREFILL_TOKENS),
                rows.field(i, QUEUED_PREFILL_PAIRS),
            ) + transfer
                + prefill.get(new, |new| params.prefill_time(new, ask.prompt_tokens - new))
        })
        .collect())
}

/// One row's load as `QuillScorer` reads it: the row's own, or a bound's.
#[derive(Debug, Clone, Copy)]
struct RowLoad {
    in_flight: f64,
    queued: f64,
    pairs: f64,
    decodes: f64,
    mean_context: f64,
}

impl RowLoad {
    fn of(rows: &Rows<'_>, i: usize) -> Self {
        Self {
            in_flight: rows.field(i, IN_FLIGHT),
            queued: rows.field(i, QUEUED_PREFILL_TOKENS),
            pairs: rows.field(i, QUEUED_PREFILL_PAIRS),
            decodes: rows.field(i, RUNNING_DECODES),
            mean_context: rows.field(i, MEAN_CONTEXT_TOKENS),
        }
    }
}

/// `QuillCacheRouter.estimate_s`, row by row, with what the rows share computed once.
struct QuillScorer<'a> {
    params: &'a CostParams,
    rows: &'a Rows<'a>,
    ask: &'a Ask,
    knobs: &'a QuillKnobs,
    peers: Vec<i64>,
    out: f64,
    kv_read: f64,
    home_weight: f64,
    /// The compute of one block's prefill with nothing cached: what an evicted block
    /// costs when it is needed again.
    block_compute: f64,
    compute: ByNewTokens,
    prefill: ByNewTokens,
}

impl<'a> QuillScorer<'a> {
    fn new(
        params: &'a CostParams,
        rows: &'a Rows<'a>,
        ask: &'a Ask,
        knobs: &'a QuillKnobs,
    ) -> Self {
        let peers = if params.allow_peer_fetch {
            peer_blocks(rows)
        } else {
            Vec::new()
        };
        let out = knobs.expected_output_tokens as f64;
        Self {
            params,
            rows,
            ask,
            knobs,
            peers,
            out,
            kv_read: (ask.prompt_tokens as f64 + out / 2.0) * params.kv_read_s_per_token,
            home_weight: knobs.home_decode_weight * out,
            block_compute: params.prefill_compute_s(ask.block_size as f64, 0.0),
            compute: ByNewTokens::new(),
            prefill: ByNewTokens::new(),
        }
    }

    /// Row `i`'s score with load `load` (its own, or a bound's), session batch and pace
    /// (how many times slower than the fleet the engine is: every term the engine
    /// computes or reads is that many times longer; a transfer is not).
    fn estimate(&mut self, i: usize, load: RowLoad, terms: RowTerm) -> f64 {
        let RowTerm {
            batch,
            pace,
            slots,
            free,
        } = terms;
        let (params, rows, ask, knobs) = (self.params, self.rows, self.ask, self.knobs);
        let prompt = ask.prompt_tokens;
        let RowLoad {
            in_flight,
            queued,
            pairs,
            decodes,
            mean_context,
        } = load;
        let mut gpu = rows.gpu[i];
        if knobs.speculative {
            gpu = gpu.max(rows.pending[i]);
        }
        let gpu = gpu.min(ask.blocks);
        let (covered, transfer) =
            params.covered(rows, ask, i, gpu, self.peers.get(i).copied().unwrap_or(0));
        let new = new_tokens(ask, covered); // at least 1
        let new_compute = self.compute.get(new, |new| {
            params.prefill_compute_s(new as f64, (prompt - new) as f64)
        });
        let mut extra = 0.0;
        if knobs.work_weight != 0.0 {
            let mut lambda = knobs.lambda;
            if knobs.per_worker_lambda {
                let waiting = maximum(in_flight - decodes, 0.0);
                lambda = minimum(
                    knobs.work_weight * (knobs.work_base + waiting),
                    knobs.max_work_weight,
                );
            }
            if knobs.continuing {
                lambda *= knobs.continuing_work_weight;
            }
            extra = 0.0 + lambda * (pace * new_compute);
        }
        // (pace 1.0 multiplies exactly: a uniform fleet's scores are bit for bit the same)
        let ttft = if knobs.interference {
            transfer
                + pace
                    * params.loaded_prefill_time(
                        queued,
                        pairs,
                        new,
                        new_compute,
                        decodes,
                        mean_context,
                    )
        } else {
            transfer
                + pace * params.queue_time(queued, pairs)
                + pace
                    * self
                        .prefill
                        .get(new, |new| params.prefill_time(new, prompt - new))
        };
        let ttft =
            ttft + pace * params.slot_wait(in_flight, decodes, mean_context, self.out, slots);
        let excess = decodes - knobs.mean_decodes;
        if knobs.decode_weight != 0.0 && !knobs.continuing && excess > 0.0 {
            let step = pace * params.decode_step_time(decodes, mean_context);
            let overlap = if step > 0.0 {
                maximum(self.out - ttft / step, 0.0)
            } else {
                self.out
            };
            extra += knobs.decode_weight * excess * overlap * (pace * self.kv_read);
        }
        if let Some(batch) = batch {
            extra += self.home_weight * (pace * (batch * params.kv_read_s_per_token));
        }
        if knobs.evict_weight != 0.0 {
            // the blocks it places there beyond the free ones push cached blocks out
            let evicted = maximum((ask.blocks - gpu) as f64 - free, 0.0);
            extra += knobs.evict_weight * evicted * self.block_compute;
        }
        extra + ttft
    }

    /// A lower bound of the score of every row that holds what row `i` holds (the same
    /// tiers, nothing pending) and has `queued` tokens queued, non-decreasing in
    /// `queued`, when `walkable`: the score with nothing running or waiting there and
    /// no session batch. Every term of the score is non-decreasing in the running
    /// decodes, their context, the requests waiting and the batch, or an added term
    /// that is at least 0; IEEE rounding is monotone, so the computed numbers keep
    /// that order. It is taken at pace 1.0, the least a pace can be (`walkable`): a
    /// slower engine's score is only larger.
    fn bound(&mut self, i: usize, queued: f64, batch: bool) -> f64 {
        // the fewest pairs `queued` tokens can have (each attends to itself): a later
        // row in the walk, with at least as many queued tokens, has at least as many
        let idle = RowLoad {
            in_flight: 0.0,
            queued,
            pairs: queued,
            decodes: 0.0,
            mean_context: 0.0,
        };
        // nothing in flight: no wait for a slot, whatever the engine's count; free
        // blocks without end: nothing evicted (the term only adds)
        let terms = RowTerm {
            batch: batch.then_some(0.0),
            pace: 1.0,
            slots: 0.0,
            free: f64::INFINITY,
        };
        self.estimate(i, idle, terms)
    }

    /// Whether `bound` is a lower bound under these knobs (with loads that are finite
    /// and at least 0, which the control plane guarantees): no peer fetch (a row's
    /// score would depend on the best other row), weights that only add, and paces of
    /// at least 1.0.
    fn walkable(&self, pace: Option<&[f64]>) -> bool {
        let k = self.knobs;
        pace.is_none_or(|p| p.iter().all(|&x| x >= 1.0))
            && !self.params.allow_peer_fetch
            && k.work_weight >= 0.0
            && k.continuing_work_weight >= 0.0
            && k.decode_weight >= 0.0
            && k.mean_decodes >= 0.0
            && k.home_decode_weight >= 0.0
            && k.evict_weight >= 0.0
            && k.expected_output_tokens >= 0
            && self.ask.prompt_tokens >= 0
            && self.params.kv_read_s_per_token >= 0.0
    }
}

/// What `quill` reads per row besides the view's columns.
#[derive(Debug, Clone, Copy, Default)]
pub struct RowTerms<'a> {
    /// Per row, the KV tokens a new session's home's decodes read each step (None: no
    /// home term).
    pub session_kv_tokens: Option<&'a [f64]>,
    /// Per row, how many times slower than the fleet its engine is (None: 1.0).
    pub pace: Option<&'a [f64]>,
    /// Per row, its engine's sequence slots (`max_num_seqs`; None or 0: the cost
    /// model's).
    pub slots: Option<&'a [f64]>,
    /// The fleet matrix (`FLEET_WIDTH` per row, row-major): a row's free blocks are its
    /// capacity minus its resident blocks, when both are known (a capacity above 0,
    /// residency known); None, or not known: no eviction term.
    pub fleet: Option<&'a [f64]>,
}

/// One row's `RowTerms`.
#[derive(Debug, Clone, Copy)]
struct RowTerm {
    batch: Option<f64>,
    pace: f64,
    slots: f64,
    /// Free blocks (infinite when not known).
    free: f64,
}

impl RowTerms<'_> {
    fn check(&self, rows: &Rows<'_>) -> Result<(), RowsError> {
        rows.check(self.session_kv_tokens)?;
        for (what, column) in [("paces", self.pace), ("slot counts", self.slots)] {
            if let Some(c) = column {
                if c.len() != rows.len() {
                    return Err(RowsError::Lengths(format!(
                        "{} {what} for {} rows",
                        c.len(),
                        rows.len()
                    )));
                }
            }
        }
        if let Some(f) = self.fleet {
            if f.len() != rows.len() * FLEET_WIDTH {
                return Err(RowsError::Lengths(format!(
                    "{} fleet values for {} rows of {FLEET_WIDTH}",
                    f.len(),
                    rows.len()
                )));
            }
        }
        Ok(())
    }

    fn row(&self, i: usize) -> RowTerm {
        RowTerm {
            batch: self.batch(i),
            pace: self.pace(i),
            slots: self.slots.map_or(0.0, |s| s[i]),
            free: self.free(i),
        }
    }

    fn free(&self, i: usize) -> f64 {
        let Some(f) = self.fleet else {
            return f64::INFINITY;
        };
        let row = &f[i * FLEET_WIDTH..(i + 1) * FLEET_WIDTH];
        if row[CAPACITY_BLOCKS] > 0.0 && row[RESIDENCY_KNOWN] != 0.0 {
            row[CAPACITY_BLOCKS] - row[RESIDENT_BLOCKS]
        } else {
            f64::INFINITY
        }
    }

    fn batch(&self, i: usize) -> Option<f64> {
        self.session_kv_tokens.map(|b| b[i])
    }

    fn pace(&self, i: usize) -> f64 {
        self.pace.map_or(1.0, |p| p[i])
    }
}

/// `QuillCacheRouter.estimates`: TTFT plus the work and decode load a choice adds.
pub fn quill_estimates(
    params: &CostParams,
    rows: &Rows<'_>,
    ask: &Ask,
    knobs: &QuillKnobs,
    terms: RowTerms<'_>,
) -> Result<Vec<f64>, RowsError> {
    terms.check(rows)?;
    let mut scorer = QuillScorer::new(params, rows, ask, knobs);
    Ok((0..rows.len())
        .map(|i| scorer.estimate(i, RowLoad::of(rows, i), terms.row(i)))
        .collect())
}

/// What `lowest_walk` asks of a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Eval {
    /// Its score.
    Score,
    /// A lower bound of the score of it and of every row after it in the walk's order
    /// that holds what it holds.
    Bound,
}

/// `lowest(scores, rows, with_pending)` without scoring every row: the rows in
/// `special` (every row that holds more of the request than the others, or has some of
/// it pending), then the others in `by_queue` order, until a row's bound exceeds the
/// best score so far: no later row can then win or tie. None when a score is NaN (which
/// `lowest` orders by position alone).
fn lowest_walk(
    rows: &Rows<'_>,
    with_pending: bool,
    special: &[usize],
    by_queue: impl Iterator<Item = usize>,
    mut eval: impl FnMut(usize, Eval) -> f64,
) -> Result<Option<usize>, RowsError> {
    let n = rows.len();
    // `lowest`'s order: score, longest prefix (held, or pending too), fewest in
    // flight, id, then position (the first among equals)
    type Key = (f64, i64, f64, u64, usize);
    let mut best: Option<Key> = None;
    let consider = |i: usize, score: f64, best: &mut Option<Key>| {
        let in_flight = rows.field(i, IN_FLIGHT);
        if score.is_nan() || in_flight.is_nan() {
            return false;
        }
        let local = rows.local(i);
        let reuse = -if with_pending {
            local.max(rows.pending[i])
        } else {
            local
        };
        let k = (score, reuse, in_flight, rows.worker[i], i);
        if best.is_none_or(|b| k.partial_cmp(&b) == Some(std::cmp::Ordering::Less)) {
            *best = Some(k);
        }
        true
    };
    let mut is_special = vec![false; n];
    for &i in special {
        if i >= n {
            return Err(RowsError::Lengths(format!("position {i} of {n} rows")));
        }
        is_special[i] = true;
        if !consider(i, eval(i, Eval::Score), &mut best) {
            return Ok(None);
        }
    }
    for i in by_queue {
        if i >= n {
            return Err(RowsError::Lengths(format!("position {i} of {n} rows")));
        }
        if is_special[i] {
            continue;
        }
        if let Some(b) = best {
            if eval(i, Eval::Bound) > b.0 {
                break;
            }
        }
        if !consider(i, eval(i, Eval::Score), &mut best) {
            return Ok(None);
        }
    }
    Ok(best.map(|b| b.4))
}

/// `lowest(&quill_estimates(..), rows, true)` by `lowest_walk`: the bound of a row is
/// `QuillScorer::bound`. None when the knobs do not allow it or a score is NaN: score
/// every row.
pub fn quill_lowest_walk(
    params: &CostParams,
    rows: &Rows<'_>,
    ask: &Ask,
    knobs: &QuillKnobs,
    terms: RowTerms<'_>,
    special: &[usize],
    by_queue: impl Iterator<Item = usize>,
) -> Result<Option<usize>, RowsError> {
    terms.check(rows)?;
    let mut scorer = QuillScorer::new(params, rows, ask, knobs);
    if !scorer.walkable(terms.pace) {
        return Ok(None);
    }
    lowest_walk(rows, true, special, by_queue, |i, what| match what {
        Eval::Score => scorer.estimate(i, RowLoad::of(rows, i), terms.row(i)),
        Eval::Bound => {
            let queued = rows.field(i, QUEUED_PREFILL_TOKENS);
            scorer.bound(i, queued, terms.session_kv_tokens.is_some())
        }
    })
}

/// `lowest(&ttft_estimates(..), rows, false)` by `lowest_walk`. A row that holds what
/// the others hold differs from them by its queue alone (queue time, then the same
/// transfer and prefill). Its bound is its estimate with the fewest attention pairs its
/// queued tokens can have (each attends to itself): a later row in the walk has at
/// least as many queued tokens, so at least as many pairs, and the queue time never
/// decreases with either. Not its own estimate: a row with the same queued tokens but
/// more pairs would end the walk before a later, cheaper one. None with peer fetch (a
/// row's estimate then depends on the best other row) or a NaN estimate: score every
/// row.
pub fn ttft_lowest_walk(
    params: &CostParams,
    rows: &Rows<'_>,
    ask: &Ask,
    special: &[usize],
    by_queue: impl Iterator<Item = usize>,
) -> Result<Option<usize>, RowsError> {
    rows.check(None)?;
    if params.allow_peer_fetch {
        return Ok(None);
    }
    let mut prefill = ByNewTokens::new();
    let estimate = |i: usize, what: Eval| {
        let gpu = rows.gpu[i].min(ask.blocks);
        let (covered, transfer) = params.covered(rows, ask, i, gpu, 0);
        let new = new_tokens(ask, covered);
        let queued = rows.field(i, QUEUED_PREFILL_TOKENS);
        let pairs = match what {
            Eval::Score => rows.field(i, QUEUED_PREFILL_PAIRS),
            Eval::Bound => queued,
        };
        params.queue_time(queued, pairs)
            + transfer
            + prefill.get(new, |new| params.prefill_time(new, ask.prompt_tokens - new))
    };
    lowest_walk(rows, false, special, by_queue, estimate)
}

/// `(running decodes, requests waiting)` summed over the rows in order, as a loop over
/// the workers adds them (waiting: in flight minus running decodes, at least 0).
pub fn load_sums(load: &[f64]) -> (f64, f64) {
    load.chunks_exact(LOAD_WIDTH)
        .fold((0.0, 0.0), |(decodes, waiting), row| {
            let d = row[RUNNING_DECODES];
            (decodes + d, waiting + maximum(row[IN_FLIGHT] - d, 0.0))
        })
}

/// The row that wins: the lowest estimate, then the longest reusable prefix (local
/// tiers, and the blocks being computed there when `with_pending`), then the fewest in
/// flight, then the lowest id; the first row among equals (`first_min`).
pub fn lowest(estimates: &[f64], rows: &Rows<'_>, with_pending: bool) -> Result<usize, RowsError> {
    rows.check(None)?;
    if estimates.len() != rows.len() {
        return Err(RowsError::Lengths(format!(
            "{} estimates for {} rows",
            estimates.len(),
            rows.len()
        )));
    }
    let reuse = |i: usize| {
        let local = rows.local(i);
        -if with_pending {
            local.max(rows.pending[i])
        } else {
            local
        }
    };
    let mut best = 0;
    for i in 1..rows.len() {
        let (a, b) = (estimates[i], estimates[best]);
        let better = a < b
            || (a == b
                && (reuse(i), rows.field(i, IN_FLIGHT), rows.worker[i]).partial_cmp(&(
                    reuse(best),
                    rows.field(best, IN_FLIGHT),
                    rows.worker[best],
                )) == Some(std::cmp::Ordering::Less));
        if better {
            best = i;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floor_divide_is_numpys() {
        // Python: -7.5 // 2 == -4.0, 7.5 // -2 == -4.0, -0.0 // 3 == -0.0, 6 // 3 == 2
        assert_eq!(floor_divide(-7.5, 2.0), -4.0);
        assert_eq!(floor_divide(7.5, -2.0), -4.0);
        assert!(floor_divide(-0.0, 3.0).is_sign_negative());
        assert_eq!(floor_divide(6.0, 3.0), 2.0);
        assert_eq!(floor_divide(-1.0, 8192.0), -1.0);
        assert!(floor_divide(1.0, 0.0).is_infinite());
    }

    proptest::proptest! {
        #[test]
        fn floor_and_trunc_are_stds(x in proptest::num::f64::ANY) {
            if x.abs() < EXACT_INTEGERS {
                proptest::prop_assert_eq!(floor(x).to_bits(), x.floor().to_bits());
            }
            proptest::prop_assert_eq!(trunc(x).to_bits(), x.trunc().to_bits());
        }

        #[test]
        fn the_integer_shortcut_floors_as_numpy_does(
            a in -(1i64 << 52) + 1..(1i64 << 52),
            b in 1i64..(1 << 40),
            small in -100_000i64..100_000,
        ) {
            for a in [a as f64, small as f64, -(small as f64), -0.0] {
                let (fast, slow) = (floor_divide(a, b as f64), floor_divide_fmod(a, b as f64));
                proptest::prop_assert_eq!(fast.to_bits(), slow.to_bits(), "{} // {}", a, b);
            }
        }
    }

    #[test]
    fn nan_propagates_as_in_numpy() {
        assert!(maximum(f64::NAN, 1.0).is_nan());
        assert!(maximum(1.0, f64::NAN).is_nan());
        assert!(minimum(1.0, f64::NAN).is_nan());
    }
}
