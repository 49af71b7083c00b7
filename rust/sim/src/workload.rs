//! [`Workload::from_bytes`]: a small workload from arbitrary bytes, for the fuzzer.

use kvpark_core::{PlannerConfig, Policy};

use crate::{SimConfig, SimRequest, Workload};

impl Workload {
    /// A small workload decoded from arbitrary bytes (for the fuzzer): every byte string gives
    /// a valid one; missing bytes read as 0. Bit 4 of the flags byte turns the prefix cache on,
    /// and then each request takes one more byte for its shared prefix.
    pub fn from_bytes(data: &[u8]) -> Self {
        let mut bytes = data.iter().copied();
        let mut next = move || usize::from(bytes.next().unwrap_or(0));
        let page_size = [1, 2, 4, 8, 16][next() % 5];
        let n_pages = 2 + next() % 40;
        let parallel = 1 + next() % 6;
        let max_batch_tokens = parallel + next() % 64;
        let flags = next();
        let bytes_per_cell = 1 + (next() as u64) * 97;
        let budget = match (flags >> 2) % 4 {
            0 => None,
            1 => Some(0),
            2 => Some((1 + next() as u64 % 8) * 64 * 1024),
            _ => Some(next() as u64 * 4096),
        };
        let ms_per_step = 10 + (next() as u64 % 20) * 10;
        let n_requests = 1 + next() % 10;
        let prefix_cache = flags & 16 != 0;
        let mut arrival_step = 0;
        let requests = (0..n_requests)
            .map(|_| {
                arrival_step += (next() % 8) as u64;
                let n_byte = next();
                let prompt_len = 1 + next() % (n_pages * page_size + 8);
                let output_len = 1 + next() % 48;
                // With the cache on: most prompts start with one of 3 shared streams, a
                // quarter of them all stream (a chat's earlier turns), the rest partly.
                let shared = if prefix_cache { next() } else { 0 };
                let prefix_len = match shared % 4 {
                    _ if !prefix_cache => 0,
                    0 => 0,
                    1 => prompt_len,
                    _ => prompt_len * (1 + (shared >> 4) % 4) / 4,
                };
                SimRequest {
                    prompt_len,
                    output_len,
                    arrival_step,
                    n: if n_byte % 8 == 7 {
                        2 + (n_byte >> 3) % 2
                    } else {
                        1
                    },
                    prefix_id: ((shared >> 2) % 3) as u32,
                    prefix_len,
                }
            })
            .collect();
        Workload {
            config: SimConfig {
                n_cells: n_pages * page_size,
                page_size,
                parallel,
                max_batch_tokens,
                bytes_per_cell,
                ms_per_step,
                prefix_cache,
                planner: PlannerConfig {
                    policy: if flags & 1 == 0 {
                        Policy::Fcfs
                    } else {
                        Policy::Cost
                    },
                    park_ahead: flags & 2 == 0,
                    ram_budget: budget,
                    ..PlannerConfig::default()
                },
            },
            requests,
        }
    }
}
