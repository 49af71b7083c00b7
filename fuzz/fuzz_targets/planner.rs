//! The planner and the pool through a workload decoded from the fuzzer's bytes: the simulator
//! (`kvpark_sim`, rust/sim) checks every invariant each step and returns the first violation,
//! which this target turns into a crash for libFuzzer to minimise.
#![no_main]

use kvpark_sim::{run, Workload};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let workload = Workload::from_bytes(data);
    if let Err(violation) = run(&workload) {
        panic!("{violation}\n{workload:#?}");
    }
});
