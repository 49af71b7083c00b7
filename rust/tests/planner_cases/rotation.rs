//! Rotation: a parked head that waited long enough swaps places with residents.

use super::*;

/// A 256-cell pool: residents of 64 (arrival 2) and 96 (arrival 3) cells; a parked head
/// (arrival 1) needing 120, parked at 0 in slot 0.
fn rotation_case() -> (KvPool, Vec<RequestView>) {
    let p = pool(256, 16, &[(1, 64), (2, 96)]);
    let reqs = vec![
        parked(7, 1, RECOMPUTE, 120, 0, 0),
        running(5, 2, 1, 64),
        running(6, 3, 2, 96),
    ];
    (p, reqs)
}

#[test]
fn a_head_that_waited_two_seconds_rotates_out_the_resident_that_makes_room_with_fewest_cells() {
    let (p, reqs) = rotation_case();
    // 160 + 128 + 16 > 256: the head does not fit. Before 2 s it waits.
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 1999).unwrap(),
        none()
    );
    // Either resident makes room (96 + 128 + 16 <= 256): the one with fewer cells goes.
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 2000).unwrap();
    let rotate = |victim| Action::Rotate {
        victim,
        mode: ParkMode::Recompute,
        buffer_capacity: 0,
        head: 7,
    };
    assert_eq!(actions, vec![rotate(5)]);

    // A resident resumed 1 s ago with 10 tokens since is protected: the other one goes.
    let mut protected = reqs.clone();
    protected[1].resumed_at_ms = Some(1000);
    protected[1].tokens_since_resume = 10;
    let actions = plan(&p, &protected, &no_ram(), &recompute_only(), 2000).unwrap();
    assert_eq!(actions, vec![rotate(6)]);
    // ... until it has decoded 32 tokens,
    protected[1].tokens_since_resume = 32;
    let actions = plan(&p, &protected, &no_ram(), &recompute_only(), 2000).unwrap();
    assert_eq!(actions, vec![rotate(5)]);
    // ... or one token and 2 s.
    protected[1].tokens_since_resume = 1;
    assert_eq!(
        plan(&p, &protected, &no_ram(), &recompute_only(), 2999).unwrap(),
        vec![rotate(6)]
    );
    assert_eq!(
        plan(&p, &protected, &no_ram(), &recompute_only(), 3000).unwrap(),
        vec![rotate(5)]
    );
    // No token yet: protected however long.
    protected[1].tokens_since_resume = 0;
    assert_eq!(
        plan(&p, &protected, &no_ram(), &recompute_only(), 90_000).unwrap(),
        vec![rotate(6)]
    );
}

#[test]
fn when_no_resident_makes_room_alone_the_largest_goes_first() {
    let (p, mut reqs) = rotation_case();
    reqs[0].resume_cells = 200; // 208: needs both out (0 + 208, margin waived)
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 2000).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::Park {
                id: 6,
                mode: ParkMode::Recompute,
                buffer_capacity: 0,
                head: Some(7)
            },
            Action::Rotate {
                victim: 5,
                mode: ParkMode::Recompute,
                buffer_capacity: 0,
                head: 7
            },
        ]
    );
}

#[test]
fn no_rotation_when_even_every_candidate_cannot_make_room() {
    let (p, mut reqs) = rotation_case();
    reqs[2].family = true;
    reqs[0].resume_cells = 200; // needs the family's cells too
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 9000).unwrap(),
        none()
    );
}

#[test]
fn a_lone_resident_is_rotated_out() {
    let p = pool(256, 16, &[(1, 200)]);
    let reqs = vec![parked(7, 1, RECOMPUTE, 200, 0, 0), running(5, 2, 1, 200)];
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 2000).unwrap();
    assert_eq!(
        actions,
        vec![Action::Rotate {
            victim: 5,
            mode: ParkMode::Recompute,
            buffer_capacity: 0,
            head: 7
        }]
    );
}

#[test]
fn a_rotation_swaps_only_if_the_budget_holds_both_states_at_once() {
    let (p, mut reqs) = rotation_case();
    reqs[0].state = SWAP; // the head's 128 K state sits in slot 0's buffer
    reqs[1].state_bytes = 100 * K;
    let ram = RamView {
        slot_buffer_capacity: vec![128 * K],
    };
    let rotate = |mode, buffer_capacity| Action::Rotate {
        victim: 5,
        mode,
        buffer_capacity,
        head: 7,
    };
    let cfg = |budget| PlannerConfig {
        ram_budget: Some(budget),
        ..PlannerConfig::default()
    };
    // 128 K held + 128 K for the resident: both at once.
    let actions = plan(&p, &reqs, &ram, &cfg(256 * K), 2000).unwrap();
    assert_eq!(actions, vec![rotate(ParkMode::Swap, 128 * K)]);
    // A budget that holds one state but not two: the resident is rotated by recompute.
    let actions = plan(&p, &reqs, &ram, &cfg(200 * K), 2000).unwrap();
    assert_eq!(actions, vec![rotate(ParkMode::Recompute, 0)]);
}

#[test]
fn no_rotation_while_a_park_copy_is_in_flight() {
    let (mut p, mut reqs) = rotation_case();
    p.add_sequence(3).unwrap();
    p.reserve(3, 16).unwrap();
    reqs[0].resume_cells = 100;
    reqs.push(RequestView {
        seq_ids: vec![3],
        slot: 3,
        ..RequestView::new(8, 4, RequestState::Parking)
    });
    assert_eq!(
        plan(&p, &reqs, &no_ram(), &recompute_only(), 9000).unwrap(),
        none()
    );
}
