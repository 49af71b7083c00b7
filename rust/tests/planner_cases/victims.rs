//! Who is parked: the cost policy's choice of victims, its ties, and the cap on re-parking.

use super::*;

#[test]
fn cost_parks_the_one_victim_that_covers_the_shortfall() {
    let (p, reqs, cfg) = three_residents(1400);
    assert_eq!(plan(&p, &reqs, &no_ram(), &cfg, 0).unwrap(), vec![park(2)]);
    // fcfs parks the newest first, then the next.
    let fcfs = PlannerConfig {
        policy: Policy::Fcfs,
        ..cfg
    };
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &fcfs, 0).unwrap(),
        vec![park(3), park(2)]
    );
}

#[test]
fn cost_covers_with_the_fewest_cells() {
    let (p, reqs, cfg) = three_residents(500);
    assert_eq!(plan(&p, &reqs, &no_ram(), &cfg, 0).unwrap(), vec![park(3)]);
}

#[test]
fn cost_parks_the_smallest_when_nobody_covers_and_repeats() {
    let (p, reqs, cfg) = three_residents(1600);
    // Nobody covers 1600: the smallest (300); then 1300 short: 1500 covers it.
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &cfg, 0).unwrap(),
        vec![park(1), park(2)]
    );
}

#[test]
fn cost_ties_go_to_the_newest() {
    let p = pool(2408, 4, &[(1, 600), (2, 600), (3, 600)]);
    let reqs = vec![
        running(7, 1, 1, 600),
        running(8, 3, 2, 600),
        running(9, 2, 3, 600),
    ];
    let cfg = PlannerConfig {
        policy: Policy::Cost,
        margin_cells: 8 + 600 + 8 + 400,
        ..recompute_only()
    };
    assert_eq!(plan(&p, &reqs, &no_ram(), &cfg, 0).unwrap(), vec![park(8)]);
}

#[test]
fn a_request_parked_three_times_is_passed_over_while_another_exists() {
    let (pool, mut reqs) = three_crossing();
    reqs[2].parks = 3; // the newest
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(20), park(30)]);
    // Only starved candidates left: the guard gives way.
    reqs[0].parks = 3;
    reqs[1].parks = 4;
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(10), park(20)]);
}
