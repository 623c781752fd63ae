//! The shortlist of a router that picks the lowest estimated time, for the booking
//! step of several gateways: `quillcache.routing.shortlist.cost_preferences`, the
//! readable reference, translated operation for operation so that the counts are
//! bit-identical (`tests/routing/test_router_shortlist.py` checks it over random
//! views). The booking runs it once per routed request, where a few numpy calls on a
//! handful of rows cost many times the arithmetic.

use std::cmp::Ordering;

use crate::scoring::{CostParams, IN_FLIGHT, LOAD_WIDTH, QUEUED_PREFILL_TOKENS, RUNNING_DECODES};

/// One shortlist row: the view position, how many requests like this one it stays
/// preferred for, and how many more with the request's prefix being computed there.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Preference {
    pub position: usize,
    pub requests: f64,
    pub pending_requests: f64,
}

/// Why no shortlist was computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShortlistError {
    #[error("the columns disagree on the number of rows: {0}")]
    Lengths(String),
    #[error("position {0} is not a row of a view of {1} rows")]
    Position(usize, usize),
    #[error("a score is NaN")]
    NotANumber,
}

/// The blocks of the request each row holds on GPU and is computing.
#[derive(Debug, Clone, Copy)]
pub struct Held<'a> {
    pub gpu: &'a [i64],
    pub pending: &'a [i64],
}

/// A shortlist in load units, and the (ceiling, credit) of an engine outside it.
pub type LoadUnits = (Vec<Unit>, Option<(f64, f64)>);

/// What one request adds to a row's queue and how it stands against the fleet.
#[derive(Debug, Clone, Copy)]
pub struct Ask {
    pub prompt_tokens: i64,
    /// The request's whole blocks (its content keys).
    pub blocks: i64,
    pub block_size: i64,
}

/// `_one_more`: the queue one more request of `prompt` tokens adds where `cached` of
/// them are held: its uncached tokens, attending to the cached ones.
fn one_more(params: &CostParams, prompt: i64, cached: i64) -> f64 {
    let new = (prompt - cached.min(prompt)).max(1);
    let new_f = new as f64;
    let context = (prompt - new) as f64;
    let pairs = new_f * (context + (new_f + 1.0) / 2.0);
    params.queue_time(new_f, pairs)
}

/// `_preferred_for`: 1 (this request) plus how many more requests, each adding `step`
/// to `score`, keep it at or below `rival`; 1 when any of them is not a positive
/// finite number.
fn preferred_for(score: f64, rival: f64, step: f64) -> f64 {
    if !(step > 0.0 && score.is_finite() && rival.is_finite() && step.is_finite()) {
        return 1.0;
    }
    1.0 + (rival - score).max(0.0) / step
}

/// `cost_preferences` over a view's rows: `scores` (seconds, one per row; the decision
/// at `position`), the blocks each row holds on GPU and is computing, and, for a router
/// that counts a prefix being computed as reusable, each row's score were the whole
/// prefix held there (`scores_if_held`). The decision first, then the `size - 1`
/// lowest-scored other rows (ties: view order). NaN scores are refused (the reference
/// orders them as numpy does).
pub fn cost_preferences(
    params: &CostParams,
    scores: &[f64],
    scores_if_held: Option<&[f64]>,
    held: &Held<'_>,
    position: usize,
    size: usize,
    ask: &Ask,
) -> Result<Vec<Preference>, ShortlistError> {
    let (gpu, pending) = (held.gpu, held.pending);
    let n = scores.len();
    if gpu.len() != n || pending.len() != n || scores_if_held.is_some_and(|h| h.len() != n) {
        return Err(ShortlistError::Lengths(format!(
            "{n} scores, {} gpu, {} pending, {:?} held scores",
            gpu.len(),
            pending.len(),
            scores_if_held.map(<[f64]>::len)
        )));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    if position >= n {
        return Err(ShortlistError::Position(position, n));
    }
    if scores.iter().any(|s| s.is_nan()) {
        return Err(ShortlistError::NotANumber);
    }
    let mut by_score: Vec<usize> = (0..n).collect();
    // stable, and no NaN: ties keep view order
    by_score.sort_by(|&a, &b| scores[a].partial_cmp(&scores[b]).unwrap_or(Ordering::Equal));
    let lowest = scores[by_score[0]];
    let second = if n > 1 {
        scores[by_score[1]]
    } else {
        f64::INFINITY
    };
    // the decision's row always leads (a size of 0 lists it alone, as the reference)
    let take = size.min(n).max(1);
    let mut order = Vec::with_capacity(take);
    order.push(position);
    order.extend(
        by_score
            .iter()
            .copied()
            .filter(|&r| r != position)
            .take(take - 1),
    );
    let bs = ask.block_size;
    let step_held = one_more(params, ask.prompt_tokens, ask.blocks * bs);
    let mut out = Vec::with_capacity(order.len());
    for r in order {
        let s = scores[r];
        let rival = if s <= lowest { second } else { lowest }; // the best row other than r
        let held = match scores_if_held {
            Some(_) => gpu[r].max(pending[r]),
            None => gpu[r],
        };
        let step = one_more(params, ask.prompt_tokens, held.min(ask.blocks) * bs);
        let requests = preferred_for(s, rival, step);
        let more = match scores_if_held {
            Some(h) => (preferred_for(h[r], rival, step_held) - requests).max(0.0),
            None => 0.0,
        };
        out.push(Preference {
            position: r,
            requests,
            pending_requests: more,
        });
    }
    Ok(out)
}

/// How the booking step weighs an engine's shared load (`LoadWeights`).
#[derive(Debug, Clone, Copy)]
pub struct Weights {
    pub in_flight: f64,
    pub queued_tokens: f64,
    pub decodes: f64,
}

/// A shortlist row in the booking step's load units (`Candidate`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Unit {
    pub worker: u64,
    pub rank: i64,
    pub ceiling: f64,
    pub credit: f64,
    /// The request's leading blocks the row holds or is computing.
    pub held: i64,
}

/// A view's columns, as `load_units` reads them (`Rows` with the ranks).
#[derive(Debug, Clone, Copy)]
pub struct Columns<'a> {
    pub worker: &'a [u64],
    pub rank: &'a [i64],
    /// `LOAD_WIDTH` values per row, row-major.
    pub load: &'a [f64],
    pub gpu: &'a [i64],
    pub cpu: &'a [i64],
    pub disk: &'a [i64],
    pub pending: &'a [i64],
}

/// `prefill_tokens`: what the plane books as a request's prefill.
fn prefill_tokens(prompt: i64, cached_blocks: i64, block_size: i64) -> i64 {
    (prompt - cached_blocks * block_size).max(1)
}

/// `quillcache.state.shortlist.shortlist_of`, the reference: a router's preferences
/// in load units. A row's ceiling is its load plus `requests` times the load one
/// request like this one adds there, its credit `pending_requests` times the load of
/// one whose prefix is held; `outside` (ceiling, credit) is the first row's, holding
/// none of the prefix.
pub fn load_units(
    columns: &Columns<'_>,
    preferences: &[Preference],
    weights: &Weights,
    ask: &Ask,
) -> Result<LoadUnits, ShortlistError> {
    let c = columns;
    let n = c.worker.len();
    let lens = [
        c.rank.len(),
        c.gpu.len(),
        c.cpu.len(),
        c.disk.len(),
        c.pending.len(),
    ];
    if c.load.len() != n * LOAD_WIDTH || lens.iter().any(|&l| l != n) {
        return Err(ShortlistError::Lengths(format!(
            "{n} ids, {} load values, ranks/tiers/pending {lens:?}",
            c.load.len()
        )));
    }
    if let Some(p) = preferences.iter().find(|p| p.position >= n) {
        return Err(ShortlistError::Position(p.position, n));
    }
    let (w_n, w_q, w_d) = (weights.in_flight, weights.queued_tokens, weights.decodes);
    let unit_of =
        |cached: i64| w_n + w_q * prefill_tokens(ask.prompt_tokens, cached, ask.block_size) as f64;
    let hit_unit = unit_of(ask.blocks);
    let cold_unit = unit_of(0);
    let mut out = Vec::with_capacity(preferences.len());
    let mut outside = None;
    for p in preferences {
        let r = p.position;
        let row = &c.load[r * LOAD_WIDTH..(r + 1) * LOAD_WIDTH];
        let (a, b, d) = (
            row[IN_FLIGHT],
            row[QUEUED_PREFILL_TOKENS],
            row[RUNNING_DECODES],
        );
        let held = c.gpu[r].max(c.cpu[r]).max(c.disk[r]).max(c.pending[r]);
        let seen = w_n * a + w_q * b + w_d * d;
        let credit = p.pending_requests * hit_unit;
        out.push(Unit {
            worker: c.worker[r],
            rank: c.rank[r],
            ceiling: seen + p.requests * unit_of(held.min(ask.blocks)),
            credit,
            held,
        });
        if outside.is_none() {
            outside = Some((seen + p.requests * cold_unit, credit));
        }
    }
    Ok((out, outside))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> CostParams {
        CostParams {
            linear_flops_per_token: 1.6e10,
            attn_flops_per_pair: 5.0e5,
            flops_per_s: 3.0e14,
            overhead_s: 0.002,
            weight_read_s: 0.008,
            kv_read_s_per_token: 1e-7,
            chunk_budget: 2048,
            block_size: 16,
            kv_bytes_per_token: 131_072,
            transfer_latency_s: 0.0001,
            cpu_gbps: 20.0,
            disk_gbps: 5.0,
            peer_gbps: 50.0,
            allow_peer_fetch: false,
            max_num_seqs: 256,
        }
    }

    const ZEROS: [i64; 4] = [0; 4];

    fn held(n: usize) -> Held<'static> {
        Held {
            gpu: &ZEROS[..n],
            pending: &ZEROS[..n],
        }
    }

    const ASK: Ask = Ask {
        prompt_tokens: 256,
        blocks: 16,
        block_size: 16,
    };

    #[test]
    fn the_decision_leads_then_the_lowest_others_in_view_order() {
        let scores = [0.5, 0.2, 0.2, 0.9];
        let got = cost_preferences(&params(), &scores, None, &held(4), 3, 3, &ASK).unwrap();
        let rows: Vec<usize> = got.iter().map(|p| p.position).collect();
        assert_eq!(rows, vec![3, 1, 2]);
        // the decision's row trails its best rival: preferred for this request only
        assert_eq!(got[0].requests, 1.0);
        assert!(got.iter().all(|p| p.pending_requests == 0.0));
    }

    #[test]
    fn a_lead_buys_requests_at_the_queue_each_adds() {
        let scores = [0.1, 0.3];
        let got = cost_preferences(&params(), &scores, None, &held(2), 0, 2, &ASK).unwrap();
        let step = one_more(&params(), 256, 0);
        assert_eq!(got[0].requests, 1.0 + (0.3_f64 - 0.1).max(0.0) / step);
        assert_eq!(got[1].requests, 1.0);
    }

    #[test]
    fn load_units_weigh_the_rows_seen_and_the_request_there() {
        let load = [
            2.0, 300.0, 0.0, 0.0, 0.0, 0.0, //
            1.0, 0.0, 1.0, 0.0, 0.0, 0.0,
        ];
        let columns = Columns {
            worker: &[10, 11],
            rank: &[0, 1],
            load: &load,
            gpu: &[0, 4],
            cpu: &[0, 0],
            disk: &[0, 0],
            pending: &[0, 0],
        };
        let prefs = [
            Preference {
                position: 1,
                requests: 3.0,
                pending_requests: 2.0,
            },
            Preference {
                position: 0,
                requests: 1.0,
                pending_requests: 0.0,
            },
        ];
        let w = Weights {
            in_flight: 1.0,
            queued_tokens: 0.01,
            decodes: 0.5,
        };
        let ask = Ask {
            prompt_tokens: 150,
            blocks: 9,
            block_size: 16,
        };
        let (units, outside) = load_units(&columns, &prefs, &w, &ask).unwrap();
        let unit4 = 1.0 + 0.01 * (150 - 4 * 16) as f64;
        let hit = 1.0 + 0.01 * 6.0; // 150 - 9 x 16 tokens left to prefill
        assert_eq!((units[0].worker, units[0].rank, units[0].held), (11, 1, 4));
        assert_eq!(units[0].ceiling, 1.0 + 0.5 + 3.0 * unit4);
        assert_eq!(units[0].credit, 2.0 * hit);
        assert_eq!(units[1].ceiling, 2.0 + 3.0 + (1.0 + 0.01 * 150.0));
        assert_eq!(outside, Some((1.0 + 0.5 + 3.0 * (1.0 + 1.5), 2.0 * hit)));
        let bad = [Preference {
            position: 2,
            ..prefs[0]
        }];
        assert_eq!(
            load_units(&columns, &bad, &w, &ask),
            Err(ShortlistError::Position(2, 2))
        );
    }

    #[test]
    fn a_size_of_zero_or_one_lists_the_decision_alone() {
        for size in [0, 1] {
            let got =
                cost_preferences(&params(), &[0.5, 0.2], None, &held(2), 0, size, &ASK).unwrap();
            assert_eq!(got.iter().map(|p| p.position).collect::<Vec<_>>(), vec![0]);
        }
    }

    #[test]
    fn bad_columns_are_refused() {
        let p = params();
        assert!(matches!(
            cost_preferences(
                &p,
                &[0.1, 0.2],
                None,
                &Held {
                    gpu: &[0],
                    pending: &[0, 0]
                },
                0,
                2,
                &ASK
            ),
            Err(ShortlistError::Lengths(_))
        ));
        assert_eq!(
            cost_preferences(&p, &[0.1], None, &held(1), 1, 2, &ASK),
            Err(ShortlistError::Position(1, 1))
        );
        assert_eq!(
            cost_preferences(&p, &[f64::NAN], None, &held(1), 0, 2, &ASK),
            Err(ShortlistError::NotANumber)
        );
        assert_eq!(
            cost_preferences(&p, &[], None, &held(0), 0, 2, &ASK),
            Ok(vec![])
        );
    }
}
