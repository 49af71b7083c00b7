//! When the planner parks: only when the step will not fit, never a lone request, never a family
//! or a refused request, and freeing only what a park really frees.

use super::*;

#[test]
fn fcfs_parks_the_newest_until_the_step_fits() {
    let (pool, reqs) = three_crossing();
    // 48 used + 48 step + 16 margin = 112 > 64: park the newest (arrival 3, id 10): 80 > 64;
    // then arrival 2: 48 <= 64.
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(10), park(20)]);
}

#[test]
fn a_step_inside_its_pages_costs_nothing_and_the_margin_is_a_page() {
    let pool = pool(64, 16, &[(1, 20), (2, 20)]);
    // 64 used; the steps stay inside the partly used pages: 64 + 0 + 16 > 64 still parks,
    // because the margin is a whole page.
    let reqs = vec![running(1, 1, 1, 21), running(2, 2, 2, 32)];
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(2)]);
    let cfg = PlannerConfig {
        margin_cells: 0,
        ..recompute_only()
    };
    assert_eq!(plan(&pool, &reqs, &no_ram(), &cfg, 0).unwrap(), none());
}

#[test]
fn a_lone_request_is_never_parked_and_fails_only_if_it_cannot_fit_an_empty_pool() {
    // Alone, 48 + 16 fits without the margin: nothing to do.
    let p = pool(64, 16, &[(1, 48)]);
    let lone = running(1, 1, 1, 49);
    assert_eq!(
        plan(&p, &[lone], &no_ram(), &recompute_only(), 0).unwrap(),
        none()
    );
    // 64 + 16 cannot fit even an empty pool: the context error.
    let p = pool(64, 16, &[(1, 64)]);
    let lone = running(1, 1, 1, 65);
    let actions = plan(&p, &[lone], &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![Action::Fail { id: 1 }]);
}

#[test]
fn a_request_that_cannot_fit_alone_is_failed_instead_of_parking_the_others() {
    let p = pool(64, 16, &[(1, 16), (2, 32)]);
    let reqs = vec![running(1, 1, 1, 17), running(2, 2, 2, 80)];
    let actions = plan(&p, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![Action::Fail { id: 2 }]);
}

#[test]
fn families_and_refused_requests_are_never_victims() {
    let (pool, mut reqs) = three_crossing();
    reqs[2].family = true; // the newest
    reqs[1].refused = true; // the next
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(30)]);
}

#[test]
fn a_request_with_nothing_to_free_is_passed_over() {
    let (pool, mut reqs) = three_crossing();
    reqs.push(RequestView {
        slot: 9,
        ..RequestView::new(99, 9, RequestState::Running)
    });
    let actions = plan(&pool, &reqs, &no_ram(), &recompute_only(), 0).unwrap();
    assert_eq!(actions, vec![park(10), park(20)]);
}

#[test]
fn a_shared_prefix_does_not_inflate_what_a_park_frees() {
    // 1 and 2 share two full pages (2 forked from 1) and each has a private third page; 3 and
    // 4 hold a page each.
    let mut p = pool(128, 16, &[(1, 32), (3, 16), (4, 16)]);
    p.fork(1, 2).unwrap();
    p.reserve(1, 48).unwrap();
    p.reserve(2, 48).unwrap();
    assert_eq!(p.cells_used(), 96);
    let reqs = vec![
        running(4, 0, 4, 16),
        running(3, 1, 3, 16),
        running(1, 2, 1, 48),
        running(2, 3, 2, 48),
    ];
    let cfg = |policy, short: usize| PlannerConfig {
        policy,
        margin_cells: 32 + short, // 96 + 32 + short - 128
        ..recompute_only()
    };
    // fcfs, 48 short: 2 alone frees its private page (16); with 1 too, all four pages (64).
    // Summing per-victim figures (16 + 16) would park 3 as well.
    let actions = plan(&p, &reqs, &no_ram(), &cfg(Policy::Fcfs, 48), 0).unwrap();
    assert_eq!(actions, vec![park(2), park(1)]);
    // cost, 32 short: nobody frees 32 alone (the shared pages are not 1's or 2's alone), so
    // the smallest (ties: newest) goes, then the fewest cells that cover the remaining 16.
    let actions = plan(&p, &reqs, &no_ram(), &cfg(Policy::Cost, 32), 0).unwrap();
    assert_eq!(actions, vec![park(2), park(3)]);
}
