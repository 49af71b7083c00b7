//! What the planner is handed: requests in flight, the lookahead off, and the snapshot itself
//! (its order, its errors).

use super::*;

// ---------------------------------------------------------------------------------- in flight

#[test]
fn in_flight_requests_are_neither_victims_nor_resumed_and_a_restore_counts_as_running() {
    // 1 runs, 2 is restoring; both cross a page: 32 + 32 + 16 > 64.
    let p = pool(64, 16, &[(1, 16), (2, 16)]);
    let restoring = RequestView {
        state: RequestState::Restoring,
        ..running(2, 2, 2, 17)
    };
    let reqs = vec![running(1, 1, 1, 17), restoring];
    // The restore is not a victim, but it runs: 1 is not alone, so 1 is parked.
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 0).unwrap(),
        vec![park(1)]
    );
}

// ---------------------------------------------------------------------------------- off

#[test]
fn without_the_lookahead_plan_does_not_park_and_choose_victims_covers_a_failed_step() {
    let (p, reqs) = three_crossing();
    let off = PlannerConfig {
        park_ahead: false,
        ..recompute_only()
    };
    assert_eq!(plan(&p, &reqs, &no_ram(), &off, 0).unwrap(), none());
    // The step needed 48 cells, 16 were free: 32 short. Each victim gains 16 held + 16 step.
    assert_eq!(
        choose_victims(&p, &reqs, &no_ram(), &off, 32).unwrap(),
        vec![park(10)]
    );
    assert_eq!(
        choose_victims(&p, &reqs, &no_ram(), &off, 33).unwrap(),
        vec![park(10), park(20)]
    );
    // Never the last one running.
    assert_eq!(
        choose_victims(&p, &reqs, &no_ram(), &off, 1000).unwrap(),
        vec![park(10), park(20)]
    );
    assert_eq!(
        choose_victims(&p, &reqs, &no_ram(), &off, 0).unwrap(),
        none()
    );
}

// ---------------------------------------------------------------------------------- snapshot

#[test]
fn the_plan_does_not_depend_on_the_order_of_the_snapshot() {
    let (p, mut reqs, cfg) = three_residents(1600);
    reqs.push(parked(9, 0, RECOMPUTE, 4, 0, 9));
    for policy in [Policy::Fcfs, Policy::Cost] {
        let cfg = PlannerConfig {
            policy,
            ..cfg.clone()
        };
        let want = plan(&p, &reqs, &no_ram(), &cfg, 0).unwrap();
        assert!(!want.is_empty());
        let mut shuffled = reqs.clone();
        for _ in 0..reqs.len() {
            shuffled.rotate_left(1);
            assert_eq!(plan(&p, &shuffled, &no_ram(), &cfg, 0).unwrap(), want);
            shuffled.reverse();
            assert_eq!(plan(&p, &shuffled, &no_ram(), &cfg, 0).unwrap(), want);
        }
    }
}

#[test]
fn a_bad_snapshot_is_an_error() {
    let (p, mut reqs) = three_crossing();
    reqs.push(running(10, 9, 7, 1));
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 0),
        Err(KvError::DuplicateRequest(10))
    );
    reqs.pop();
    reqs.push(parked(11, 9, SWAP, 1, 0, 1));
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 0),
        Err(KvError::DuplicateSlot(1))
    );
    reqs.pop();
    reqs.push(running(11, 9, 42, 1));
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 0),
        Err(KvError::UnknownSequence(42))
    );
}
