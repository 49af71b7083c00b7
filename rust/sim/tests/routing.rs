//! The routing simulation (`run_fleet`, rust/sim/src/replicas.rs) on small cases: its policies
//! do what docs/scale-out.md says, every replica's invariants hold throughout (a violation is
//! an error), and a run is a function of its seed.

use kvpark_core::PlannerConfig;
use kvpark_sim::{run_fleet, Conversations, Fleet, FleetReport, Routing, SimConfig, StepCost};

const COST: StepCost = StepCost {
    fixed_ms: 6.3,
    row_ms: 0.64,
    cell_us: 8.4,
};

fn fleet(replicas: usize, routing: Routing, n_cells: usize, per_second: f64) -> Fleet {
    Fleet {
        replicas,
        engine: SimConfig {
            n_cells,
            page_size: 16,
            parallel: 4,
            max_batch_tokens: 128,
            bytes_per_cell: 1024,
            ms_per_step: 20,
            prefix_cache: true,
            planner: PlannerConfig {
                ram_budget: Some(1 << 20),
                ..PlannerConfig::default()
            },
        },
        cost: COST,
        routing,
        workload: Conversations {
            seed: 7,
            count: 24,
            per_second,
            turns: (3, 5),
            first_prompt: (60, 200),
            message: (10, 40),
            answer: (10, 40),
            think_s: 2.0,
        },
    }
}

fn run(f: &Fleet) -> FleetReport {
    run_fleet(f).unwrap_or_else(|v| panic!("{:?} x{}: {v}", f.routing, f.replicas))
}

#[test]
fn prefix_aware_routing_hits_far_more_of_the_history_than_round_robin_and_answers_sooner() {
    let rr = run(&fleet(4, Routing::RoundRobin, 2048, 2.0));
    let prefix = run(&fleet(4, Routing::PrefixAware, 2048, 2.0));
    assert_eq!(rr.requests, prefix.requests);
    assert_eq!(rr.failed + prefix.failed, 0);
    // every later turn finds its whole history but the last partly used page where it was
    // served: nearly all of a conversation's prompt tokens after the first turn
    assert!(prefix.hit_rate() > 0.6, "{}", prefix.hit_rate());
    assert!(
        prefix.hit_rate() > 1.5 * rr.hit_rate(),
        "{} vs {}",
        prefix.hit_rate(),
        rr.hit_rate()
    );
    assert!(prefix.ttft_percentile(50.0) < rr.ttft_percentile(50.0));
    assert_eq!(prefix.ttft_ms.len(), prefix.requests);
}

#[test]
fn on_one_replica_every_policy_is_the_same_run() {
    let runs: Vec<FleetReport> = [
        Routing::RoundRobin,
        Routing::LeastLoaded,
        Routing::PrefixAware,
    ]
    .into_iter()
    .map(|r| run(&fleet(1, r, 2048, 2.0)))
    .collect();
    assert_eq!(runs[0], runs[1]);
    assert_eq!(runs[0], runs[2]);
}

#[test]
fn a_small_pool_parks_and_least_loaded_spreads_the_load_better_than_round_robin() {
    // pools of 512 cells, four slots and histories up to ~600 tokens: replicas park
    let rr = run(&fleet(3, Routing::RoundRobin, 512, 4.0));
    let least = run(&fleet(3, Routing::LeastLoaded, 512, 4.0));
    assert!(rr.parks > 0, "{rr:?}");
    assert_eq!(rr.failed + least.failed, 0);
    assert!(least.parks <= rr.parks, "{} vs {}", least.parks, rr.parks);
}

#[test]
fn a_run_is_a_function_of_its_seed() {
    let f = fleet(4, Routing::PrefixAware, 1024, 3.0);
    assert_eq!(run(&f), run(&f));
    let mut other = f.clone();
    other.workload.seed += 1;
    assert_ne!(run(&f).ttft_ms, run(&other).ttft_ms);
}
