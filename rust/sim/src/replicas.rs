//! Replicas of the engine behind a router, on a multi-turn chat workload (docs/scale-out.md).
//!
//! Each replica is the engine simulation of `engine/` (admission, chunked prompts, the Rust
//! planner's parks, the prefix cache), driven a step at a time (`engine/live.rs`) on a clock of
//! its own: a step takes [`StepCost::ms`] of its work (fixed cost, a cost per row, a cost per
//! cell a row attends over), the model fitted to kvpark's measured step times. The router sees
//! every replica as a real router would through `/metrics` and `/slots` and its own record of
//! what it sent: free cells, the prompts it has sent a replica that have no first token yet,
//! and, for prefix-aware routing, how much of a prompt a replica's prefix cache holds (in
//! kvpark, the pool events of `GET /v1/pool/events`, or the router's own map of conversations
//! to replicas).
//!
//! A conversation's turn `k + 1` arrives a think time after turn `k` ended, and its prompt is
//! the whole history (every earlier prompt and answer) plus a new message: each conversation is
//! one token stream (`engine/tokens.rs`), so a turn's prompt starts with exactly the tokens
//! the previous turn's replica computed and cached. Time advances in event order: the busy
//! replica furthest behind steps next, unless an arrival comes first.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::engine::{Event, Sim, Work};
use crate::{Outcome, SimConfig, SimRequest, Violation};

/// A step's duration from its work: `fixed_ms + rows * row_ms + positions * cell_us / 1000`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    pub fixed_ms: f64,
    pub row_ms: f64,
    /// Per cell a row attends over (the sum of the rows' positions).
    pub cell_us: f64,
}

impl StepCost {
    pub fn ms(&self, rows: u64, positions: u64) -> f64 {
        self.fixed_ms + rows as f64 * self.row_ms + positions as f64 * self.cell_us / 1000.0
    }
}

/// How the router picks a replica for each request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// Replicas in turn.
    RoundRobin,
    /// The most free cells, less the prompts sent it that have no first token yet.
    LeastLoaded,
    /// The replica whose prefix cache holds the longest part of the prompt (a page at least),
    /// unless it has no room for the rest of the prompt; else least-loaded.
    PrefixAware,
}

/// The multi-turn workload: conversations arrive as a Poisson process; lengths are uniform in
/// their ranges (inclusive), think times exponential.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversations {
    pub seed: u64,
    pub count: usize,
    pub per_second: f64,
    pub turns: (usize, usize),
    pub first_prompt: (usize, usize),
    pub message: (usize, usize),
    pub answer: (usize, usize),
    pub think_s: f64,
}

/// Replicas, their engines, the step-time model, the router and the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct Fleet {
    pub replicas: usize,
    pub engine: SimConfig,
    pub cost: StepCost,
    pub routing: Routing,
    pub workload: Conversations,
}

/// What a fleet's run did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetReport {
    pub requests: usize,
    pub failed: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens admissions took from cached pages.
    pub hit_tokens: u64,
    /// Swap and recompute parks, every replica's.
    pub parks: u64,
    /// Every answered request's time to first token (arrival at the router to the end of the
    /// step that sampled it), sorted.
    pub ttft_ms: Vec<f64>,
    /// When the last request ended.
    pub end_ms: f64,
}

impl FleetReport {
    pub fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// The `p`-th percentile (0-100) of the TTFTs, nearest rank.
    pub fn ttft_percentile(&self, p: f64) -> f64 {
        let n = self.ttft_ms.len();
        if n == 0 {
            return 0.0;
        }
        let rank = ((p / 100.0 * n as f64).ceil() as usize).clamp(1, n);
        self.ttft_ms[rank - 1]
    }
}

/// A turn: its prompt's length, its answer's, and the think time before it (ms).
type Turn = (usize, usize, f64);
/// A conversation: when its first turn arrives (ms), and its turns.
type Plan = (f64, Vec<Turn>);

/// The workload's conversations.
fn conversations(w: &Conversations) -> Vec<Plan> {
    let mut rng = Rng(w.seed);
    let mut start = 0.0;
    (0..w.count)
        .map(|_| {
            start += rng.exponential(1000.0 / w.per_second);
            let turns = rng.between(w.turns);
            let mut history = 0;
            let plan = (0..turns)
                .map(|k| {
                    let prompt = history
                        + if k == 0 {
                            rng.between(w.first_prompt)
                        } else {
                            rng.between(w.message)
                        };
                    let answer = rng.between(w.answer);
                    history = prompt + answer;
                    let think = if k == 0 {
                        0.0
                    } else {
                        rng.exponential(w.think_s * 1000.0)
                    };
                    (prompt, answer, think)
                })
                .collect();
            (start, plan)
        })
        .collect()
}

struct Replica {
    sim: Sim,
    clock: f64,
    /// Requests pushed and not ended.
    open: usize,
    /// Prompt tokens of the requests sent here that have no first token yet.
    unanswered: usize,
    /// Per pushed request: (conversation, turn, arrival ms).
    sent: Vec<(usize, usize, f64)>,
}

impl Replica {
    /// Free cells less the prompts it has not answered yet.
    fn room(&self) -> i64 {
        self.sim.pool().cells_free() as i64 - self.unanswered as i64
    }
}

/// Runs the workload through `fleet.replicas` replicas behind the router; the first violation
/// of any replica's invariants otherwise.
pub fn run_fleet(fleet: &Fleet) -> Result<FleetReport, Violation> {
    let plans = conversations(&fleet.workload);
    let mut replicas = (0..fleet.replicas.max(1))
        .map(|_| {
            Ok(Replica {
                sim: Sim::idle(fleet.engine.clone())?,
                clock: 0.0,
                open: 0,
                unanswered: 0,
                sent: Vec::new(),
            })
        })
        .collect::<Result<Vec<_>, Violation>>()?;
    // (time in µs, conversation, turn), earliest first
    let mut arrivals: BinaryHeap<Reverse<(u64, usize, usize)>> = plans
        .iter()
        .enumerate()
        .map(|(c, (start, _))| Reverse(((start * 1000.0) as u64, c, 0)))
        .collect();
    let mut report = FleetReport::default();
    let mut turn_robin = 0;
    loop {
        let busiest = (0..replicas.len())
            .filter(|&r| replicas[r].open > 0)
            .min_by(|&a, &b| replicas[a].clock.total_cmp(&replicas[b].clock));
        let next = arrivals.peek().map(|Reverse((t, _, _))| *t as f64 / 1000.0);
        match (busiest, next) {
            (Some(r), t) if t.map_or(true, |t| replicas[r].clock <= t) => {
                let rep = &mut replicas[r];
                let (work, events) = rep.sim.step_at(rep.clock as u64)?;
                rep.clock += step_ms(&fleet.cost, work);
                for event in events {
                    settle(rep, event, &plans, &mut arrivals, &mut report);
                }
            }
            (_, Some(t)) => {
                let Reverse((_, c, k)) = arrivals.pop().expect("peeked");
                let (prompt_len, answer, _) = plans[c].1[k];
                let spec = SimRequest {
                    prompt_len,
                    output_len: answer,
                    arrival_step: 0,
                    n: 1,
                    prefix_id: c as u32,
                    prefix_len: prompt_len,
                };
                let r = route(fleet, &replicas, &spec, &mut turn_robin);
                let rep = &mut replicas[r];
                if rep.open == 0 {
                    rep.clock = rep.clock.max(t);
                }
                rep.sim.push(spec);
                rep.sent.push((c, k, t));
                rep.open += 1;
                rep.unanswered += prompt_len;
                report.requests += 1;
                report.prompt_tokens += prompt_len as u64;
            }
            _ => break,
        }
    }
    for rep in &replicas {
        report.parks += rep.sim.report().swaps + rep.sim.report().recomputes;
        report.end_ms = report.end_ms.max(rep.clock);
    }
    report.ttft_ms.sort_by(f64::total_cmp);
    Ok(report)
}

/// A step with no row still takes the fixed cost (the engine waking to find nothing to run).
fn step_ms(cost: &StepCost, work: Work) -> f64 {
    cost.ms(work.rows, work.positions)
}

fn settle(
    rep: &mut Replica,
    event: Event,
    plans: &[Plan],
    arrivals: &mut BinaryHeap<Reverse<(u64, usize, usize)>>,
    report: &mut FleetReport,
) {
    match event {
        Event::FirstToken(i) => {
            let (c, k, arrived) = rep.sent[i];
            rep.unanswered -= plans[c].1[k].0;
            report.ttft_ms.push(rep.clock - arrived);
            report.hit_tokens += rep.sim.admit_hit(i) as u64;
        }
        Event::Ended(i, outcome) => {
            rep.open -= 1;
            let (c, k, _) = rep.sent[i];
            if outcome != Outcome::Finished {
                report.failed += 1;
                return;
            }
            if let Some(&(_, _, think)) = plans[c].1.get(k + 1) {
                let at = rep.clock + think;
                arrivals.push(Reverse(((at * 1000.0) as u64, c, k + 1)));
            }
        }
    }
}

fn route(fleet: &Fleet, replicas: &[Replica], spec: &SimRequest, robin: &mut usize) -> usize {
    let least_loaded = || {
        (0..replicas.len())
            .max_by_key(|&r| (replicas[r].room(), Reverse(r)))
            .expect("a replica")
    };
    match fleet.routing {
        Routing::RoundRobin => {
            *robin += 1;
            (*robin - 1) % replicas.len()
        }
        Routing::LeastLoaded => least_loaded(),
        Routing::PrefixAware => {
            let tokens = Sim::prompt_tokens(spec);
            let held = |r: usize| {
                replicas[r]
                    .sim
                    .pool()
                    .cached_prefix(&tokens, spec.prompt_len - 1)
                    .tokens
            };
            let (best, hit) = (0..replicas.len())
                .map(|r| (r, held(r)))
                .max_by_key(|&(r, hit)| (hit, replicas[r].room(), Reverse(r)))
                .expect("a replica");
            let rest = (spec.prompt_len - hit) as i64;
            if hit >= fleet.engine.page_size && replicas[best].room() >= rest {
                best
            } else {
                least_loaded()
            }
        }
    }
}

/// splitmix64: the workload's seeded draws.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn between(&mut self, (lo, hi): (usize, usize)) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }

    fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}
