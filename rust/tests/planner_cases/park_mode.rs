//! How a victim is parked: swap or recompute by the RAM budget, and the park buffers given back
//! or grown.

use super::*;

#[test]
fn swap_or_recompute_by_the_budget() {
    let (p, mut reqs) = three_crossing();
    for r in &mut reqs {
        r.state_bytes = 100 * K;
    }
    let cfg = |budget| PlannerConfig {
        ram_budget: budget,
        ..PlannerConfig::default()
    };
    // No limit: swap, into a buffer grown to 64 KiB multiples.
    let actions = plan(&p, &reqs, &no_ram(), &cfg(None), 0).unwrap();
    assert_eq!(actions, vec![swap(10, 128 * K), swap(20, 128 * K)]);
    // Room for one state: the first swaps, the second recomputes.
    let actions = plan(&p, &reqs, &no_ram(), &cfg(Some(200 * K)), 0).unwrap();
    assert_eq!(actions, vec![swap(10, 128 * K), park(20)]);
    // 0: every park recomputes.
    let actions = plan(&p, &reqs, &no_ram(), &cfg(Some(0)), 0).unwrap();
    assert_eq!(actions, vec![park(10), park(20)]);
    // A state of 0 bytes has nothing to copy.
    reqs[2].state_bytes = 0;
    let actions = plan(&p, &reqs, &no_ram(), &cfg(None), 0).unwrap();
    assert_eq!(actions, vec![park(10), swap(20, 128 * K)]);
}

#[test]
fn idle_buffers_are_given_back_largest_first_and_only_as_many_as_needed() {
    let (p, mut reqs) = three_crossing();
    reqs.truncate(2); // slots 1 and 2 run; the victim is id 20 in slot 2
    reqs[1].state_bytes = 256 * K;
    // Slot 0: a swapped state (busy). Slot 2: the victim's own. Slots 4, 5, 6: idle.
    reqs.push(parked(40, 0, SWAP, 16, 0, 0));
    let ram = RamView {
        slot_buffer_capacity: vec![512 * K, 0, 64 * K, 0, 128 * K, 256 * K, 192 * K],
    };
    let cfg = PlannerConfig {
        ram_budget: Some(1024 * K),
        margin_cells: 48,
        ..PlannerConfig::default()
    };
    // held 1152 K; the victim's buffer grows 64 -> 256 K: 1344 K. Give back 256 K (slot 5),
    // then 192 K (slot 6): 896 K <= 1024 K. Slot 4 stays. Grown 1.5x? 896 - 64 + 2 * 256 >
    // 1024: no, exactly the state.
    let actions = plan(&p, &reqs, &ram, &cfg, 0).unwrap();
    assert_eq!(
        actions,
        vec![
            Action::ReleaseBuffer { slot: 5 },
            Action::ReleaseBuffer { slot: 6 },
            swap(20, 256 * K),
        ]
    );
    // If even every idle buffer cannot make room, nothing is given back: recompute.
    reqs[1].state_bytes = 1024 * K;
    let actions = plan(&p, &reqs, &ram, &cfg, 0).unwrap();
    assert_eq!(actions, vec![park(20)]);
}

#[test]
fn ties_between_idle_buffers_go_to_the_lowest_slot() {
    let (p, mut reqs) = three_crossing();
    reqs.truncate(2);
    reqs[1].state_bytes = 64 * K;
    let ram = RamView {
        slot_buffer_capacity: vec![0, 0, 0, 128 * K, 128 * K],
    };
    let cfg = PlannerConfig {
        ram_budget: Some(256 * K),
        margin_cells: 48,
        ..PlannerConfig::default()
    };
    let actions = plan(&p, &reqs, &ram, &cfg, 0).unwrap();
    assert_eq!(
        actions,
        vec![Action::ReleaseBuffer { slot: 3 }, swap(20, 64 * K)]
    );
}

#[test]
fn a_park_buffer_grows_by_half_again_only_while_the_budget_holds_two() {
    assert_eq!(BUFFER_ALIGN, 64 * K);
    // Holds the state: kept, whatever the budget.
    assert_eq!(round_up_buffer(300 * K, 512 * K, 512 * K, Some(0)), 512 * K);
    // 1.5 x 512 K = 768 K; held - cap + 2 x 768 K = 1536 K.
    assert_eq!(
        round_up_buffer(600 * K, 512 * K, 512 * K, Some(1536 * K)),
        768 * K
    );
    assert_eq!(
        round_up_buffer(600 * K, 512 * K, 512 * K, Some(1535 * K)),
        640 * K
    );
    assert_eq!(round_up_buffer(600 * K, 512 * K, 512 * K, None), 768 * K);
    // The state beyond 1.5x: the state, rounded.
    assert_eq!(round_up_buffer(1000 * K, 512 * K, 512 * K, None), 1024 * K);
    // Other slots' buffers count against the second state.
    assert_eq!(
        round_up_buffer(600 * K, 512 * K, 1024 * K, Some(2000 * K)),
        640 * K
    );
    assert_eq!(round_up_buffer(1, 0, 0, None), 64 * K);
    assert_eq!(round_up_buffer(u64::MAX, 0, 0, None), u64::MAX);

    // In a plan: the victim's slot holds 256 K and the state needs 257 K: 384 K grown, 320 K
    // exact.
    let (p, mut reqs) = three_crossing();
    reqs.truncate(2);
    reqs[1].state_bytes = 257 * K;
    let ram = RamView {
        slot_buffer_capacity: vec![0, 0, 256 * K],
    };
    let cfg = |budget| PlannerConfig {
        ram_budget: Some(budget),
        margin_cells: 48,
        ..PlannerConfig::default()
    };
    for (budget, want) in [
        (768 * K, swap(20, 384 * K)),
        (767 * K, swap(20, 320 * K)),
        (320 * K, swap(20, 320 * K)),
        (319 * K, park(20)),
    ] {
        assert_eq!(plan(&p, &reqs, &ram, &cfg(budget), 0).unwrap(), vec![want]);
    }
}
