//! The planner and the pool driven together through workloads by `kvpark_sim` (rust/sim), which
//! checks every invariant each step (see its module documentation): first the original
//! system's scenarios, then random workloads under both policies, budgets none / 0 / small,
//! with and without the lookahead.

use kvpark_core::planner::PlannerConfig;
use kvpark_core::Policy;
use kvpark_sim::{run, Outcome, Report, SimConfig, SimRequest, Workload};
use proptest::prelude::*;

fn config(
    n_cells: usize,
    parallel: usize,
    max_batch_tokens: usize,
    budget: Option<u64>,
) -> SimConfig {
    SimConfig {
        n_cells,
        page_size: 16,
        parallel,
        max_batch_tokens,
        bytes_per_cell: 740, // tinyllama's, as in the original tests
        ms_per_step: 20,
        prefix_cache: false,
        planner: PlannerConfig {
            ram_budget: budget,
            ..PlannerConfig::default()
        },
    }
}

fn req(prompt_len: usize, output_len: usize, arrival_step: u64) -> SimRequest {
    SimRequest {
        prompt_len,
        output_len,
        arrival_step,
        n: 1,
        prefix_id: 0,
        prefix_len: 0,
    }
}

fn run_ok(w: &Workload) -> Report {
    run(w).unwrap_or_else(|v| panic!("{v}\n{w:#?}"))
}

fn all_finished(report: &Report) -> bool {
    report
        .outcomes
        .iter()
        .all(|&o| o == Some(Outcome::Finished))
}

const MIB: u64 = 1024 * 1024;

// ---------------------------------------------------------------------------------- scenarios

#[test]
fn two_generations_that_do_not_fit_together_both_finish() {
    // Each fits alone (168 of 256 cells), together 336 > 256.
    for policy in [Policy::Fcfs, Policy::Cost] {
        for budget in [None, Some(0), Some(8192 * MIB)] {
            for park_ahead in [true, false] {
                let mut config = config(256, 2, 64, budget);
                config.planner.policy = policy;
                config.planner.park_ahead = park_ahead;
                let w = Workload {
                    config,
                    requests: vec![req(8, 160, 0), req(8, 160, 0)],
                };
                let report = run_ok(&w);
                assert!(all_finished(&report), "{report:?}");
                assert!(report.swaps + report.recomputes >= 1, "{report:?}");
                assert_eq!(report.resumes, report.swaps + report.recomputes);
                if budget == Some(0) {
                    assert_eq!(report.swaps, 0);
                }
                if !park_ahead {
                    assert!(report.late_parks >= 1, "{report:?}");
                }
            }
        }
    }
}

#[test]
fn two_prompts_near_the_pool_size_both_complete() {
    // Two 240-token prompts in a 256-cell pool, 4 tokens each: the second waits (or is parked
    // before its first token) and is let in whole once the pool is empty.
    let w = Workload {
        config: config(256, 2, 256, None),
        requests: vec![req(240, 4, 0), req(240, 4, 0)],
    };
    assert!(all_finished(&run_ok(&w)));
}

#[test]
fn a_request_that_cannot_fit_gets_the_context_error_and_the_others_finish() {
    let w = Workload {
        config: config(256, 3, 64, Some(0)),
        requests: vec![req(100, 200, 0), req(300, 4, 0), req(50, 20, 1)],
    };
    let report = run_ok(&w);
    assert_eq!(
        report.outcomes,
        [
            Some(Outcome::ContextError),
            Some(Outcome::Refused),
            Some(Outcome::Finished)
        ]
    );
}

#[test]
fn two_long_residents_take_turns_by_rotation() {
    // Each fits alone, not together: the parked one rotates in every 2 s or so.
    for budget in [None, Some(0)] {
        let w = Workload {
            config: config(256, 2, 64, budget),
            requests: vec![req(16, 200, 0), req(16, 200, 0)],
        };
        let report = run_ok(&w);
        assert!(all_finished(&report));
        assert!(report.rotations >= 1, "{report:?}");
        // 2 s at 20 ms a step, plus the cooldown.
        assert!(report.max_head_wait <= 100 + 32, "{report:?}");
    }
}

#[test]
fn a_budget_that_holds_one_state_but_not_two_rotates_by_recompute() {
    // States of about 100 cells x 740 bytes = 74 KB: a 128 KiB buffer each.
    let w = Workload {
        config: config(256, 2, 64, Some(192 * 1024)),
        requests: vec![req(16, 200, 0), req(16, 200, 0)],
    };
    let report = run_ok(&w);
    assert!(all_finished(&report));
    assert!(
        report.rotations >= 1 && report.recomputes >= 1,
        "{report:?}"
    );
}

#[test]
fn a_small_budget_parks_both_ways() {
    let mut config = config(1024, 4, 128, Some(256 * 1024));
    config.planner.policy = Policy::Cost;
    let w = Workload {
        config,
        requests: (0..4).map(|i| req(150, 200, i)).collect(),
    };
    let report = run_ok(&w);
    assert!(all_finished(&report));
    assert!(report.swaps >= 1 && report.recomputes >= 1, "{report:?}");
}

#[test]
fn families_are_never_parked_and_overflow_only_among_themselves() {
    let w = Workload {
        config: config(512, 6, 64, None),
        requests: vec![
            SimRequest {
                n: 2,
                ..req(100, 120, 0)
            },
            req(60, 150, 0),
            req(60, 150, 2),
        ],
    };
    let report = run_ok(&w);
    assert!(all_finished(&report), "{report:?}");
}

#[test]
fn chat_turns_hit_the_pages_earlier_turns_decoded() {
    // Turn t's prompt is the shared stream's first 20 + 30 t tokens: turn t - 1's prompt plus
    // the 30 tokens it decoded (greedily, so the same). Each turn comes after the last ended.
    for budget in [None, Some(0)] {
        let mut config = config(256, 2, 64, budget);
        config.prefix_cache = true;
        let requests = (0..4)
            .map(|t| SimRequest {
                prefix_id: 1,
                prefix_len: 20 + 30 * t,
                ..req(20 + 30 * t, 31, 60 * t as u64)
            })
            .collect();
        let report = run_ok(&Workload { config, requests });
        assert!(all_finished(&report), "{report:?}");
        // Turns 1, 2, 3 hit all their whole pages but the last token's: 48 + 64 + 96.
        assert_eq!(report.hit_tokens, 48 + 64 + 96, "{report:?}");
    }
}

#[test]
fn requests_sharing_a_prompt_under_pressure_park_and_resume_from_the_cache() {
    // Four requests share a 64-token system prompt in a pool too small for all of them.
    for budget in [None, Some(0)] {
        let mut config = config(320, 4, 64, budget);
        config.prefix_cache = true;
        let requests = (0..4)
            .map(|i| SimRequest {
                prefix_id: 2,
                prefix_len: 64,
                ..req(80, 60, i)
            })
            .collect();
        let report = run_ok(&Workload { config, requests });
        assert!(all_finished(&report), "{report:?}");
        assert!(report.swaps + report.recomputes >= 1, "{report:?}");
        assert!(report.hit_tokens >= 3 * 64, "{report:?}");
    }
}

#[test]
fn a_request_whose_pages_a_family_shares_is_no_victim_for_the_familys_shortfall() {
    // Found by the random workloads: the n=1 request holds only the cached prefix page that
    // the family's first child took too, so parking it frees nothing; the family's 13-row
    // prompt chunk sits the step out instead of anyone being parked for it.
    let shared = |prompt_len, output_len, arrival_step, n, prefix_len| SimRequest {
        prefix_id: 1,
        prefix_len,
        n,
        ..req(prompt_len, output_len, arrival_step)
    };
    let mut config = config(24, 5, 15, Some(118_784));
    config.page_size = 2;
    config.prefix_cache = true;
    let w = Workload {
        config,
        requests: vec![
            shared(3, 6, 0, 1, 2),
            SimRequest {
                n: 2,
                ..req(15, 2, 5)
            },
            shared(15, 1, 5, 2, 3),
            shared(4, 1, 5, 1, 2),
        ],
    };
    assert!(all_finished(&run_ok(&w)));
}

// ---------------------------------------------------------------------------------- random

fn workload() -> impl Strategy<Value = Workload> {
    let config = (
        prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        2usize..40,
        1usize..6,
        0usize..64,
        prop_oneof![
            Just(None),
            Just(Some(0)),
            (1u64..8).prop_map(|k| Some(k * 64 * 1024)),
            (0u64..64).prop_map(|k| Some(k * 4096)),
        ],
        any::<bool>(),
        prop::bool::weighted(0.8),
        1u64..2000,
        1u64..20,
        any::<bool>(),
    );
    config.prop_flat_map(
        |(page_size, n_pages, parallel, extra, budget, cost, park_ahead, bpc, ms, cache)| {
            let n_cells = n_pages * page_size;
            let request = (
                1..n_cells + 8,
                1usize..48,
                0u64..8,
                prop::sample::select(vec![1usize, 1, 1, 1, 1, 1, 2, 3]),
                // Shared stream, and the quarters of the prompt drawn from it (4: all of it).
                (0u32..3, 0usize..=4),
            );
            prop::collection::vec(request, 1..10).prop_map(move |reqs| {
                let mut arrival = 0;
                let requests = reqs
                    .into_iter()
                    .map(
                        |(prompt_len, output_len, delta, n, (prefix_id, quarters))| {
                            arrival += delta;
                            SimRequest {
                                prompt_len,
                                output_len,
                                arrival_step: arrival,
                                n,
                                prefix_id,
                                prefix_len: if cache { prompt_len * quarters / 4 } else { 0 },
                            }
                        },
                    )
                    .collect();
                Workload {
                    config: SimConfig {
                        n_cells,
                        page_size,
                        parallel,
                        max_batch_tokens: parallel + extra,
                        bytes_per_cell: bpc,
                        ms_per_step: ms * 10,
                        prefix_cache: cache,
                        planner: PlannerConfig {
                            policy: if cost { Policy::Cost } else { Policy::Fcfs },
                            ram_budget: budget,
                            park_ahead,
                            ..PlannerConfig::default()
                        },
                    },
                    requests,
                }
            })
        },
    )
}

/// Cells a request holds at its largest (prompt plus output but the last token), in pages.
fn fits_alone(w: &Workload, r: &SimRequest) -> bool {
    let ps = w.config.page_size;
    (r.prompt_len + r.output_len - 1).div_ceil(ps) * ps <= w.config.n_cells
}

/// 1000 cases a property, or `PROPTEST_CASES` (run longer: `PROPTEST_CASES=100000`).
fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    /// Every invariant the simulator checks holds every step; every request ends; a request
    /// that is not in a family and fits the pool alone finishes; one whose prompt cannot fit
    /// is refused.
    #[test]
    fn random_workloads_keep_every_invariant(w in workload()) {
        let report = run(&w).map_err(|v| TestCaseError::fail(v.to_string()))?;
        for (r, outcome) in w.requests.iter().zip(&report.outcomes) {
            let prompt_fits = r.prompt_len.div_ceil(w.config.page_size) * w.config.page_size
                <= w.config.n_cells;
            match outcome {
                None => prop_assert!(false, "a request did not end"),
                Some(Outcome::Refused) => prop_assert!(!prompt_fits || r.n > w.config.parallel),
                Some(Outcome::ContextError) => {
                    prop_assert!(r.n > 1 || !fits_alone(&w, r), "{:?} failed", r)
                }
                Some(Outcome::Finished) => {}
            }
        }
    }

    /// The same workload gives the same run.
    #[test]
    fn runs_are_deterministic(w in workload()) {
        prop_assert_eq!(run(&w), run(&w));
    }

    /// The fuzzer's decoder: any bytes make a workload that runs clean.
    #[test]
    fn workloads_from_any_bytes_run_clean(data in prop::collection::vec(any::<u8>(), 0..64)) {
        let w = Workload::from_bytes(&data);
        run(&w).map_err(|v| TestCaseError::fail(format!("{v}\n{w:?}")))?;
    }
}
