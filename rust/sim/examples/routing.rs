//! Replicas of kvpark behind a router (docs/scale-out.md): the multi-turn chat workload over 4, 8
//! and 16 replicas, routed round-robin, least-loaded and prefix-aware; prints prefix hit rate,
//! parks and TTFT percentiles per policy.
//!
//! `cargo run --release -p kvpark-sim --example routing [SCALE]` (about two minutes in
//! release); `SCALE` multiplies every step's time (default 1: the sensitivity to the
//! calibration, docs/scale-out.md).
//!
//! Each replica is kvpark's defaults on a CPU (`--kv-cells 16384 --page-size 16 --parallel 16
//! --max-batch-tokens 512 --preempt-ram 2048`, the prefix cache on, the default model's f16
//! cells: 30 layers x 2 x 3 KV heads x 64 x 2 bytes = 23040 bytes a cell). Its step time is
//! `STEP` below, fitted to the default model's step times measured in-process on a 2-core Xeon
//! VM (docs/scale-out.md, "Calibration"). The load is the same per replica at every fleet size:
//! `PER_REPLICA` conversations a second each.

use kvpark_core::PlannerConfig;
use kvpark_sim::{run_fleet, Conversations, Fleet, Routing, SimConfig, StepCost};

/// Fitted to the measured steps: 6.3 ms a step, 0.64 ms a row, 8.4 µs a cell a row attends.
const STEP: StepCost = StepCost {
    fixed_ms: 6.3,
    row_ms: 0.64,
    cell_us: 8.4,
};
const PER_REPLICA: f64 = 0.012; // conversations a second a replica
const MINUTES: f64 = 15.0; // of arrivals

fn engine() -> SimConfig {
    SimConfig {
        n_cells: 16384,
        page_size: 16,
        parallel: 16,
        max_batch_tokens: 512,
        bytes_per_cell: 23040,
        ms_per_step: 30, // only the oracle's bounds read it: the fleet sets each step's clock
        prefix_cache: true,
        planner: PlannerConfig {
            ram_budget: Some(2048 << 20),
            ..PlannerConfig::default()
        },
    }
}

fn workload(replicas: usize) -> Conversations {
    let per_second = PER_REPLICA * replicas as f64;
    Conversations {
        seed: 31,
        count: (per_second * MINUTES * 60.0) as usize,
        per_second,
        turns: (2, 8),
        first_prompt: (200, 1000),
        message: (20, 200),
        answer: (50, 400),
        think_s: 20.0,
    }
}

fn main() {
    let scale: f64 = std::env::args()
        .nth(1)
        .map_or(1.0, |a| a.parse().expect("SCALE"));
    let cost = StepCost {
        fixed_ms: STEP.fixed_ms * scale,
        row_ms: STEP.row_ms * scale,
        cell_us: STEP.cell_us * scale,
    };
    println!(
        "| replicas | routing | requests | prefix hit rate | parks | TTFT p50 | p95 | p99 | failed |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for replicas in [4, 8, 16] {
        for (name, routing) in [
            ("round-robin", Routing::RoundRobin),
            ("least-loaded", Routing::LeastLoaded),
            ("prefix-aware", Routing::PrefixAware),
        ] {
            let fleet = Fleet {
                replicas,
                engine: engine(),
                cost,
                routing,
                workload: workload(replicas),
            };
            let r = run_fleet(&fleet).unwrap_or_else(|v| panic!("{name} x{replicas}: {v}"));
            println!(
                "| {replicas} | {name} | {} | {:.1} % | {} | {:.2} s | {:.2} s | {:.2} s | {} |",
                r.requests,
                100.0 * r.hit_rate(),
                r.parks,
                r.ttft_percentile(50.0) / 1000.0,
                r.ttft_percentile(95.0) / 1000.0,
                r.ttft_percentile(99.0) / 1000.0,
                r.failed,
            );
        }
    }
}
