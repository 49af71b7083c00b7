//! How a request is parked (its K/V swapped to a host buffer, or dropped and recomputed on
//! resume), and the park buffers held against `--preempt-ram`.
//!
//! Each slot keeps one park buffer; its capacity is what it holds against the budget, parked
//! or not. A buffer is busy while its slot holds a swapped state (parked by swap, or a copy in
//! flight) and idle otherwise: an idle buffer can be given back so that another slot can park.
//!
//! ```text
//!   slot        0         1          2         3
//!   buffer     [ 3 MiB ] [ 1 MiB  ] [ 0 ]     [ 2 MiB ]
//!   holds      swapped   (resumed)  -         (finished)
//!              busy      idle                 idle
//!   a victim in slot 2 needing 2.5 MiB under a 6 MiB budget: held 6 + 2.5 > 6, so give back
//!   slot 3 (the largest idle, 2 MiB) then slot 1: held 3 + 2.5 <= 6; swap.
//! ```

use super::{Action, ParkMode, RamView, RequestState, RequestView};

/// Park buffers are sized in multiples of this (64 KiB).
pub const BUFFER_ALIGN: u64 = 64 * 1024;

fn align(bytes: u64) -> u64 {
    bytes.div_ceil(BUFFER_ALIGN).saturating_mul(BUFFER_ALIGN)
}

/// The capacity a slot's park buffer takes to hold a `need`-byte state, given its capacity
/// `cap` now, the total `held` by every slot (this one's `cap` included) and the `budget`
/// (`None`: no limit). A buffer that holds the state keeps its capacity; a buffer that must
/// grow grows by half again, rounded up to 64 KiB (`round64K(max(need, 1.5 cap))`), only if
/// the budget would still hold a second state of the grown size (`held - cap + 2 new <=
/// budget`); else to `round64K(need)`. Whether even that fits is the caller's check.
///
/// ```
/// use kvpark_core::planner::round_up_buffer;
/// const K: u64 = 1024;
/// assert_eq!(round_up_buffer(100 * K, 0, 0, None), 128 * K);
/// assert_eq!(round_up_buffer(600 * K, 512 * K, 512 * K, None), 768 * K); // 1.5x
/// assert_eq!(round_up_buffer(600 * K, 512 * K, 512 * K, Some(1024 * K)), 640 * K); // no room for 2
/// assert_eq!(round_up_buffer(300 * K, 512 * K, 512 * K, Some(0)), 512 * K); // it holds it
/// ```
pub fn round_up_buffer(need: u64, cap: u64, held: u64, budget: Option<u64>) -> u64 {
    if need <= cap {
        return cap;
    }
    let grown = align(need.max(cap.saturating_add(cap.div_ceil(2))));
    let budget = budget.unwrap_or(u64::MAX);
    let second_fits = held
        .saturating_sub(cap)
        .saturating_add(grown.saturating_mul(2))
        <= budget;
    if second_fits {
        grown
    } else {
        align(need)
    }
}

/// The planner's model of the park buffers, updated as it decides.
pub(super) struct Ram {
    budget: Option<u64>,
    /// Per slot: buffer capacity.
    capacity: Vec<u64>,
    /// Per slot: holds a swapped state (parked by swap, copying out or back, or a victim
    /// swapped by this plan).
    busy: Vec<bool>,
}

impl Ram {
    pub(super) fn new(view: &RamView, budget: Option<u64>, requests: &[&RequestView]) -> Self {
        let slots = requests
            .iter()
            .map(|r| r.slot as usize + 1)
            .max()
            .unwrap_or(0)
            .max(view.slot_buffer_capacity.len());
        let mut capacity = view.slot_buffer_capacity.clone();
        capacity.resize(slots, 0);
        let mut busy = vec![false; slots];
        for r in requests {
            if matches!(
                r.state,
                RequestState::Parked(ParkMode::Swap)
                    | RequestState::Parking
                    | RequestState::Restoring
            ) {
                busy[r.slot as usize] = true;
            }
        }
        Self {
            budget,
            capacity,
            busy,
        }
    }

    fn held(&self) -> u64 {
        self.capacity.iter().fold(0, |a, &c| a.saturating_add(c))
    }

    /// Decides how `victim` parks: swap if its state fits the budget, after giving back idle
    /// buffers of other slots (largest first, ties to the lowest slot; the `ReleaseBuffer`
    /// actions go to `out`), else recompute, giving nothing back. Returns the mode and the
    /// buffer capacity to use (0 for recompute).
    pub(super) fn choose(
        &mut self,
        victim: &RequestView,
        out: &mut Vec<Action>,
    ) -> (ParkMode, u64) {
        let slot = victim.slot as usize;
        let need = victim.state_bytes;
        if self.budget == Some(0) || need == 0 || self.busy[slot] {
            return (ParkMode::Recompute, 0);
        }
        let budget = self.budget.unwrap_or(u64::MAX);
        let cap = self.capacity[slot];
        let extra = if need <= cap { 0 } else { align(need) - cap };
        let mut held = self.held();
        let mut release = Vec::new();
        if held.saturating_add(extra) > budget {
            let mut idle: Vec<usize> = (0..self.capacity.len())
                .filter(|&s| s != slot && !self.busy[s] && self.capacity[s] > 0)
                .collect();
            idle.sort_unstable_by_key(|&s| (std::cmp::Reverse(self.capacity[s]), s));
            for s in idle {
                if held.saturating_add(extra) <= budget {
                    break;
                }
                held -= self.capacity[s];
                release.push(s);
            }
            if held.saturating_add(extra) > budget {
                return (ParkMode::Recompute, 0);
            }
        }
        for s in release {
            self.capacity[s] = 0;
            out.push(Action::ReleaseBuffer { slot: s as u32 });
        }
        let new_cap = round_up_buffer(need, cap, held, self.budget);
        self.capacity[slot] = new_cap;
        self.busy[slot] = true;
        (ParkMode::Swap, new_cap)
    }
}
