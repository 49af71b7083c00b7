//! The worker threads: a product is split by output columns into one share per thread; the
//! calling thread computes the first share and `threads - 1` helper threads the others. Columns
//! are independent, so the split never changes a result.
//!
//! Why not rayon: between two products of a decode step the caller runs a few torch ops
//! (~0.1 ms), long enough for an idle rayon worker to go to sleep, and waking it again costs
//! tens of microseconds on a VM: ~10 ms a step over the ~120 products of the default model.
//! These helpers spin for up to [`SPIN`] after a share before they park, and the caller works
//! too, so the process keeps exactly `threads` threads busy (a third spinning thread would take
//! a core from the caller's next op on a 2-core machine).

use std::marker::PhantomData;
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long an idle helper waits for work before it parks (`KVPARK_CPU_SPIN_US` overrides it):
/// first up to `PURE_SPINS` busy loops, then yielding the core between looks.
const SPIN: Duration = Duration::from_millis(2);
const PURE_SPINS: u32 = 2000;

fn spin_time() -> Duration {
    static SPIN_TIME: OnceLock<Duration> = OnceLock::new();
    *SPIN_TIME.get_or_init(|| {
        std::env::var("KVPARK_CPU_SPIN_US")
            .ok()
            .and_then(|v| v.parse().ok())
            .map_or(SPIN, Duration::from_micros)
    })
}
/// Work below this size (weights of a product) runs on the calling thread: handing out shares
/// costs more.
const MIN_PARALLEL_WORK: usize = 64 * 1024;

/// How finely a call is cut: each claim takes the unclaimed tasks over `PIECES_PER_THREAD`
/// times the threads (at least one task), so the first pieces are long contiguous runs of
/// weights (what the hardware prefetcher and `avx2.rs`'s prefetches stream well) and no larger
/// than a quarter of a thread's share (the caller can take over most of the work of a helper the
/// OS has descheduled), and the last ones a task each: the thread that finishes first then waits
/// for at most one task of the other's, not a quarter of its share (equal pieces of an eighth
/// of a call had left the caller waiting in 3.2 % of an 8-chat F32 decode's samples, 0.9 % after).
const PIECES_PER_THREAD: usize = 4;

/// The work of one call: `tasks` numbered tasks, claimed in contiguous pieces of decreasing
/// size by whichever thread is free.
struct Job {
    run: &'static (dyn Fn(Range<usize>) + Sync),
    tasks: usize,
    threads: usize,
    /// The first unclaimed task.
    next: AtomicUsize,
}

impl Job {
    /// Claims and runs pieces until none are left.
    fn work(&self) {
        let mut start = self.next.load(Ordering::Relaxed);
        loop {
            if start >= self.tasks {
                return;
            }
            let size = ((self.tasks - start) / (PIECES_PER_THREAD * self.threads)).max(1);
            let end = start + size;
            match self
                .next
                .compare_exchange_weak(start, end, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    (self.run)(start..end);
                    start = self.next.load(Ordering::Relaxed);
                }
                Err(now) => start = now,
            }
        }
    }
}

struct Shared {
    epoch: AtomicUsize,
    /// Helpers inside the current job; they join only while `job` is set (under its lock).
    active: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
    job: Mutex<Option<Arc<Job>>>,
}

struct Team {
    threads: usize,
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
}

/// The helpers and their count; `None` until [`set_threads`] asks for more than one thread.
/// Locked for a whole call, so calls from several threads take turns.
static TEAM: Mutex<Option<Team>> = Mutex::new(None);

/// Sets how many threads the kernels use (1: the calling thread only). Cheap when unchanged.
pub fn set_threads(n: usize) {
    let n = n.max(1);
    let mut team = TEAM.lock().unwrap_or_else(|e| e.into_inner());
    if team.as_ref().map_or(1, |t| t.threads) == n {
        return;
    }
    if let Some(old) = team.take() {
        old.shared.stop.store(true, Ordering::SeqCst);
        for h in old.helpers {
            h.thread().unpark();
            let _ = h.join();
        }
    }
    if n > 1 {
        *team = Some(Team::start(n));
    }
}

impl Team {
    fn start(threads: usize) -> Self {
        let shared = Arc::new(Shared {
            epoch: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            job: Mutex::new(None),
        });
        let helpers = (1..threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                thread::Builder::new()
                    .name(format!("kvpark-cpu-{index}"))
                    .spawn(move || helper(&shared))
                    .expect("start a kvpark-cpu-ops thread")
            })
            .collect();
        Self {
            threads,
            shared,
            helpers,
        }
    }

    /// Runs `tasks` tasks on the caller and whichever helpers join in time. Tasks are claimed
    /// one by one, so a helper the OS has descheduled delays the call by at most the task it
    /// holds: the caller does the rest.
    fn run<'a>(&self, tasks: usize, run: &'a (dyn Fn(Range<usize>) + Sync + 'a)) {
        // SAFETY: helpers reach `run` only through `job`, which is cleared below before this
        // function waits for `active` to drop to zero and returns; so no use outlives `run`.
        let run = unsafe {
            std::mem::transmute::<
                &'a (dyn Fn(Range<usize>) + Sync + 'a),
                &'static (dyn Fn(Range<usize>) + Sync),
            >(run)
        };
        let job = Arc::new(Job {
            run,
            tasks,
            threads: self.threads,
            next: AtomicUsize::new(0),
        });
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::clone(&job));
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        for h in &self.helpers {
            h.thread().unpark(); // no system call unless the helper is parked
        }
        let mine = catch_unwind(AssertUnwindSafe(|| in_job(|| job.work())));
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = None; // no one joins now
        while self.shared.active.load(Ordering::Acquire) > 0 {
            std::hint::spin_loop();
        }
        if let Err(panic) = mine {
            std::panic::resume_unwind(panic);
        }
        if self.shared.panicked.swap(false, Ordering::SeqCst) {
            panic!("a kvpark-cpu-ops helper thread panicked");
        }
    }
}

fn helper(shared: &Shared) {
    let mut seen = 0;
    loop {
        let idle_since = Instant::now();
        let mut spins = 0u32;
        loop {
            if shared.stop.load(Ordering::SeqCst) {
                return;
            }
            let epoch = shared.epoch.load(Ordering::Acquire);
            if epoch != seen {
                seen = epoch;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins < PURE_SPINS && idle_since.elapsed() < spin_time() {
                std::hint::spin_loop();
            } else if idle_since.elapsed() < spin_time() {
                thread::yield_now(); // let another runnable thread (the server's) have the core
            } else {
                thread::park(); // `run` unparks; a spurious return just loops
            }
        }
        let job = {
            let current = shared.job.lock().unwrap_or_else(|e| e.into_inner());
            let Some(job) = current.as_ref() else {
                continue;
            }; // finished without us
            shared.active.fetch_add(1, Ordering::SeqCst);
            Arc::clone(job)
        };
        if catch_unwind(AssertUnwindSafe(|| in_job(|| job.work()))).is_err() {
            shared.panicked.store(true, Ordering::SeqCst);
        }
        drop(job);
        shared.active.fetch_sub(1, Ordering::Release);
    }
}

/// The output matrix, shared by threads that each write their own columns.
pub(crate) struct Output<'a> {
    ptr: *mut f32,
    len: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: threads write disjoint elements (their own columns); nothing reads until all are done.
unsafe impl Sync for Output<'_> {}

impl<'a> Output<'a> {
    pub(crate) fn new(y: &'a mut [f32]) -> Self {
        Self {
            ptr: y.as_mut_ptr(),
            len: y.len(),
            _borrow: PhantomData,
        }
    }

    pub(crate) fn set(&self, i: usize, v: f32) {
        assert!(i < self.len, "output index {i} out of {}", self.len);
        // SAFETY: in bounds (checked), and each index is written by one thread only.
        unsafe { *self.ptr.add(i) = v }
    }

    /// `y[i..i + values.len()] = values`, one bounds check for the run (a call to memmove: for
    /// long runs; [`Output::set_array`] for short ones of a fixed length).
    pub(crate) fn set_run(&self, i: usize, values: &[f32]) {
        assert!(
            i + values.len() <= self.len,
            "output run {i}..{} out of {}",
            i + values.len(),
            self.len
        );
        // SAFETY: in bounds (checked), and each index is written by one thread only.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), self.ptr.add(i), values.len()) }
    }

    /// `y[i..i + N] = values`, one bounds check for the run; a fixed-size copy, so it compiles
    /// to a few vector moves (a copy of a run whose length is known only at run time became a
    /// call to memmove per run: 9-11 % of a product's time).
    pub(crate) fn set_array<const N: usize>(&self, i: usize, values: &[f32; N]) {
        assert!(
            i + N <= self.len,
            "output run {i}..{} out of {}",
            i + N,
            self.len
        );
        // SAFETY: in bounds (checked), each index is written by one thread only, and an
        // unaligned write needs no alignment.
        unsafe { self.ptr.add(i).cast::<[f32; N]>().write_unaligned(*values) }
    }
}

/// The threads the kernels use now ([`set_threads`]; 1 before it asks for more).
pub(crate) fn team_size() -> usize {
    let team = TEAM.lock().unwrap_or_else(|e| e.into_inner());
    team.as_ref().map_or(1, |t| t.threads)
}

thread_local! {
    /// Whether this thread is running a task of a call (the caller's share or a helper's).
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `work` with [`IN_JOB`] set, restored after (a panic included: the caller catches it).
fn in_job<T>(work: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_JOB.set(self.0);
        }
    }
    let _reset = Reset(IN_JOB.replace(true));
    work()
}

/// Calls `f` on contiguous ranges that together cover `0..tasks` once, spread over the threads
/// of [`set_threads`]; on the calling thread alone (one call, `0..tasks`) when there is one
/// thread or `work` (a size, in weights or values read) is too small to split.
pub(crate) fn parallel(tasks: usize, work: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
    parallel_above(tasks, work, MIN_PARALLEL_WORK, f)
}

/// [`parallel`] with its own threshold: split where `work >= min_work`. A call from inside a
/// task (a Qwen3 head's norm inside a split rope) runs on its own thread, as does work too small
/// to split: the team is busy with the outer call, whose lock this thread may hold.
pub(crate) fn parallel_above(
    tasks: usize,
    work: usize,
    min_work: usize,
    f: &(dyn Fn(Range<usize>) + Sync),
) {
    if work < min_work || tasks <= 1 || IN_JOB.get() {
        return f(0..tasks);
    }
    let team = TEAM.lock().unwrap_or_else(|e| e.into_inner());
    match team.as_ref() {
        Some(team) => team.run(tasks, f),
        _ => {
            drop(team);
            f(0..tasks);
        }
    }
}
