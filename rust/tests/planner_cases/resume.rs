//! Resuming parked requests: in order, as many as fit, the head blocking, the margin waived.

use super::*;

#[test]
fn fcfs_resumes_the_oldest_first_and_as_many_as_fit() {
    let p = pool(128, 16, &[]);
    let reqs = vec![
        parked(1, 3, RECOMPUTE, 40, 100, 1),
        parked(2, 1, RECOMPUTE, 40, 300, 2),
        parked(3, 2, SWAP, 40, 200, 3),
    ];
    // 48 + 48 (+16) = 112 <= 128; a third: 160 > 128.
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 1000).unwrap();
    assert_eq!(
        actions,
        vec![Action::Resume { id: 2 }, Action::Resume { id: 3 }]
    );
}

#[test]
fn cost_resumes_in_park_time_order() {
    let p = pool(128, 16, &[]);
    let reqs = vec![
        parked(1, 3, RECOMPUTE, 40, 100, 1),
        parked(2, 1, RECOMPUTE, 40, 300, 2),
        parked(3, 2, SWAP, 40, 100, 3),
    ];
    let cfg = PlannerConfig {
        policy: Policy::Cost,
        ..recompute_only()
    };
    // Parked at 100: arrivals 2 then 3 (ids 3 then 1).
    let actions = plan(&p, &reqs, &no_ram(), &cfg, 1000).unwrap();
    assert_eq!(
        actions,
        vec![Action::Resume { id: 3 }, Action::Resume { id: 1 }]
    );
}

#[test]
fn a_head_that_does_not_fit_blocks_the_smaller_ones_behind_it() {
    let p = pool(128, 16, &[(9, 32)]);
    let reqs = vec![
        running(9, 9, 9, 32),
        parked(1, 1, RECOMPUTE, 90, 0, 1),
        parked(2, 2, RECOMPUTE, 16, 0, 2),
    ];
    // The head needs 96: 32 + 96 + 16 > 128. The one behind would fit, but does not pass.
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 1999).unwrap(),
        none()
    );
}

#[test]
fn the_margin_is_waived_when_nothing_is_resident() {
    let p = pool(256, 16, &[]);
    let reqs = vec![
        parked(1, 1, RECOMPUTE, 250, 0, 1),
        parked(2, 2, RECOMPUTE, 250, 0, 2),
    ];
    // 256 + 16 > 256, but with nobody resident an exact fit is let in; the second is not.
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![Action::Resume { id: 1 }]);
}

#[test]
fn a_parked_request_that_can_never_fit_is_failed_and_the_next_resumes() {
    let p = pool(256, 16, &[]);
    let reqs = vec![
        parked(1, 1, SWAP, 257, 0, 1),
        parked(2, 2, RECOMPUTE, 100, 0, 2),
    ];
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(
        actions,
        vec![Action::Fail { id: 1 }, Action::Resume { id: 2 }]
    );
}

#[test]
fn nothing_resumes_in_a_step_that_parked_for_pressure() {
    let (p, mut reqs) = three_crossing();
    reqs.push(parked(5, 0, RECOMPUTE, 1, 0, 5));
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 5000).unwrap();
    assert_eq!(actions, vec![park(10), park(20)]);
}
