//! A small pool of long-lived threads for connects and NIP-11 requests.
//!
//! A connect (DNS wait, TCP, TLS and websocket handshakes) and a NIP-11 request touch tens of
//! KiB of stack that a relay thread would keep resident for the rest of its life, so they do
//! not run on the relay thread (decision 0047). They used to run on a short-lived
//! thread each; glibc keeps the stacks of ended threads cached, each with its top 16–20 KiB
//! resident, so 1,000 relays connecting at once left hundreds of such stacks behind. A
//! [`ConnectPool`] runs them on at most `size` threads that live on (started on demand, ended
//! after [`WORKER_IDLE_EXIT`] without work), so their stacks are touched once and reused.
//!
//! A job waits for a free worker at most its *patience*; after that the caller takes it back
//! and runs it on a thread of its own (as before the pool), so connects stuck in slow
//! handshakes on every worker delay the others by at most their patience, never past their
//! deadline (a caller gives a job its deadline's remaining time, less the wait:
//! [`remaining`]).

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use log::debug;

/// Worker threads of the process-wide pool ([`connect_pool`]): connects running at once
/// beyond this wait up to their patience, then get a thread of their own.
pub(crate) const CONNECT_POOL_SIZE: usize = 16;

/// Stack of a pool worker (and of a job run on its own thread).
pub(crate) const CONNECT_THREAD_STACK: usize = 256 * 1024;

/// A worker without a job this long ends (its stack goes back to glibc's cache).
pub(crate) const WORKER_IDLE_EXIT: Duration = Duration::from_secs(300);

/// A job; it calls its argument right before it hands its answer over (a worker counts
/// itself idle then, so a caller's next job finds it free).
type Job = Box<dyn FnOnce(&dyn Fn()) + Send>;

/// A caller's function with its answer boxed.
type BoxedFn = Box<dyn FnOnce() -> Box<dyn Any + Send> + Send>;

/// A queued job; taken by a worker or, once its patience ran out, by its caller.
struct Slot {
    job: Mutex<Option<Job>>,
}

impl Slot {
    fn take(&self) -> Option<Job> {
        lock(&self.job).take()
    }
}

#[derive(Debug, Default)]
struct State {
    /// Worker threads alive.
    workers: usize,
    /// Workers waiting for a job.
    idle: usize,
    /// Jobs queued and not taken yet.
    pending: usize,
    /// The most workers ever alive at once.
    peak_workers: usize,
    /// Jobs that ran on a thread of their own (no worker free within their patience, or no
    /// worker could be started).
    overflowed: u64,
}

/// Why [`ConnectPool::run`] could not run a job.
#[derive(Debug)]
pub(crate) enum RunError {
    /// No worker was free and no thread of its own could be started.
    NoThread(std::io::Error),
    /// The job's thread ended without an answer (cannot happen short of an abort).
    Lost,
}

impl std::fmt::Display for RunError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RunError::NoThread(e) => write!(f, "cannot start a connect thread: {e}"),
            RunError::Lost => f.write_str("the connect thread ended without an answer"),
        }
    }
}

impl std::error::Error for RunError {}

/// At most `size` long-lived threads running blocking jobs (connects, NIP-11 requests) for
/// callers that wait for the answer. See the [module documentation](self).
pub(crate) struct ConnectPool {
    size: usize,
    stack: usize,
    name: String,
    idle_exit: Duration,
    jobs_tx: Sender<Arc<Slot>>,
    jobs_rx: Receiver<Arc<Slot>>,
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for ConnectPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectPool")
            .field("size", &self.size)
            .field("name", &self.name)
            .field("state", &*lock(&self.state))
            .finish()
    }
}

/// The process-wide pool every relay thread's connect and NIP-11 request run on.
pub(crate) fn connect_pool() -> &'static ConnectPool {
    static POOL: OnceLock<ConnectPool> = OnceLock::new();
    POOL.get_or_init(|| {
        ConnectPool::new(
            CONNECT_POOL_SIZE,
            CONNECT_THREAD_STACK,
            "connect",
            WORKER_IDLE_EXIT,
        )
    })
}

/// Time left until `deadline` (zero once it passed).
pub(crate) fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ConnectPool {
    /// A pool of at most `size` (at least 1) threads named `name` with `stack` bytes of stack;
    /// a worker ends after `idle_exit` without a job. No thread starts before the first job.
    pub(crate) fn new(size: usize, stack: usize, name: &str, idle_exit: Duration) -> ConnectPool {
        let (jobs_tx, jobs_rx) = crossbeam_channel::unbounded();
        ConnectPool {
            size: size.max(1),
            stack,
            name: name.to_string(),
            idle_exit,
            jobs_tx,
            jobs_rx,
            state: Arc::new(Mutex::new(State::default())),
        }
    }

    /// Worker threads alive now.
    #[cfg(test)]
    pub(crate) fn workers(&self) -> usize {
        lock(&self.state).workers
    }

    /// The most worker threads that were ever alive at once (never above the pool's size).
    #[cfg(test)]
    pub(crate) fn peak_workers(&self) -> usize {
        lock(&self.state).peak_workers
    }

    /// Jobs that ran on a thread of their own because no worker took them within their
    /// patience (or none could be started).
    #[cfg(test)]
    pub(crate) fn overflowed(&self) -> u64 {
        lock(&self.state).overflowed
    }

    /// Runs `f` on a worker and waits for its answer. When no worker takes it within
    /// `patience` (all busy), it runs on a thread of its own instead, so a job starts at most
    /// `patience` after the call (plus the time to start a thread). A panic in `f` is resumed
    /// in the caller; the worker lives on. `f` must bound its own running time (every
    /// connect has a deadline): the caller waits for it.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        patience: Duration,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, RunError> {
        // The answer is boxed on the worker: the caller's stack (a relay thread's, kept
        // resident for its life) never holds a large `T` such as a websocket in transit.
        let answer = self.run_boxed(
            patience,
            Box::new(move || Box::new(f()) as Box<dyn Any + Send>),
        )?;
        answer
            .downcast::<T>()
            .map(|v| *v)
            .map_err(|_| RunError::Lost)
    }

    /// [`ConnectPool::run`] without its type parameter (one small frame in every caller).
    #[inline(never)]
    fn run_boxed(&self, patience: Duration, f: BoxedFn) -> Result<Box<dyn Any + Send>, RunError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        let job: Job = Box::new(move |done: &dyn Fn()| {
            let answer = catch_unwind(AssertUnwindSafe(f));
            done();
            let _ = tx.send(answer);
        });
        let slot = Arc::new(Slot {
            job: Mutex::new(Some(job)),
        });
        let start_worker = {
            let mut st = lock(&self.state);
            st.pending += 1;
            let wanted = st.idle < st.pending && st.workers < self.size;
            if wanted {
                st.workers += 1;
                st.idle += 1;
                st.peak_workers = st.peak_workers.max(st.workers);
            }
            wanted
        };
        if start_worker {
            if let Err(e) = self.start_worker() {
                debug!("{}: cannot start a pool thread: {e}", self.name);
                let mut st = lock(&self.state);
                st.workers -= 1;
                st.idle -= 1;
            }
        }
        // The receiver lives as long as `self`, so this cannot fail.
        let _ = self.jobs_tx.send(slot.clone());
        let answer = match rx.recv_timeout(patience) {
            Ok(answer) => answer,
            Err(RecvTimeoutError::Disconnected) => return Err(RunError::Lost),
            Err(RecvTimeoutError::Timeout) => match slot.take() {
                // No worker took it in time: run it on a thread of its own.
                Some(job) => {
                    {
                        let mut st = lock(&self.state);
                        st.pending -= 1;
                        st.overflowed += 1;
                    }
                    debug!(
                        "{}: no free pool thread within {patience:?}; running on a thread of its own",
                        self.name
                    );
                    std::thread::Builder::new()
                        .name(self.name.clone())
                        .stack_size(self.stack)
                        .spawn(move || job(&|| {}))
                        .map_err(RunError::NoThread)?;
                    rx.recv().map_err(|_| RunError::Lost)?
                }
                // A worker runs it: wait for the answer (the job has its own deadline).
                None => rx.recv().map_err(|_| RunError::Lost)?,
            },
        };
        match answer {
            Ok(v) => Ok(v),
            Err(panic) => resume_unwind(panic),
        }
    }

    fn start_worker(&self) -> std::io::Result<()> {
        let jobs = self.jobs_rx.clone();
        let state = self.state.clone();
        let idle_exit = self.idle_exit;
        std::thread::Builder::new()
            .name(self.name.clone())
            .stack_size(self.stack)
            .spawn(move || worker(jobs, state, idle_exit))
            .map(drop)
    }
}

/// A worker: takes jobs until none came for `idle_exit`.
fn worker(jobs: Receiver<Arc<Slot>>, state: Arc<Mutex<State>>, idle_exit: Duration) {
    // Counted idle by `ConnectPool::run` when it started this worker.
    loop {
        let next = jobs.recv_timeout(idle_exit);
        let mut st = lock(&state);
        let slot = match next {
            Ok(slot) => slot,
            // A job queued meanwhile that the other idle workers cannot take: stay.
            Err(RecvTimeoutError::Timeout) if st.pending >= st.idle => continue,
            Err(_) => {
                st.idle -= 1;
                st.workers -= 1;
                return;
            }
        };
        let Some(job) = slot.take() else {
            // Taken back by its caller after its patience ran out.
            continue;
        };
        st.idle -= 1;
        st.pending -= 1;
        drop(st);
        job(&|| lock(&state).idle += 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn pool(size: usize) -> Arc<ConnectPool> {
        Arc::new(ConnectPool::new(
            size,
            64 * 1024,
            "test-pool",
            Duration::from_secs(60),
        ))
    }

    #[test]
    fn the_pool_never_runs_more_threads_than_its_size() {
        let pool = pool(3);
        let running = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..24)
            .map(|i| {
                let (pool, running, most) = (pool.clone(), running.clone(), most.clone());
                std::thread::spawn(move || {
                    pool.run(Duration::from_secs(600), move || {
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(5));
                        running.fetch_sub(1, Ordering::SeqCst);
                        i * 2
                    })
                })
            })
            .collect();
        let mut answers: Vec<usize> = callers
            .into_iter()
            .map(|c| c.join().unwrap().unwrap())
            .collect();
        answers.sort_unstable();
        assert_eq!(answers, (0..24).map(|i| i * 2).collect::<Vec<_>>());
        assert!(
            most.load(Ordering::SeqCst) <= 3,
            "jobs ran at once: {most:?}"
        );
        assert!(pool.peak_workers() <= 3, "{pool:?}");
        assert!(pool.workers() >= 1, "{pool:?}");
        assert_eq!(pool.overflowed(), 0, "{pool:?}");
    }

    #[test]
    fn idle_workers_are_reused() {
        let pool = pool(4);
        let names: Vec<_> = (0..10)
            .map(|_| {
                pool.run(Duration::from_secs(600), || std::thread::current().id())
                    .unwrap()
            })
            .collect();
        assert!(names.iter().all(|n| *n == names[0]), "{names:?}");
        assert_eq!(pool.peak_workers(), 1);
        assert_ne!(names[0], std::thread::current().id());
    }

    /// Every worker stuck in a slow job (a connect waiting out its deadline) delays another
    /// job by its patience at most: it then runs on a thread of its own.
    #[test]
    fn a_job_waits_for_a_busy_pool_no_longer_than_its_patience() {
        let pool = pool(1);
        let (release_tx, release_rx) = crossbeam_channel::bounded::<()>(0);
        let slow = {
            let pool = pool.clone();
            std::thread::spawn(move || {
                pool.run(Duration::from_secs(600), move || {
                    release_rx.recv_timeout(Duration::from_secs(600)).is_ok()
                })
            })
        };
        while pool.workers() == 0 || lock(&pool.state).pending > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        let quick = pool.run(Duration::from_millis(50), || 7).unwrap();
        let waited = started.elapsed();
        assert_eq!(quick, 7);
        assert!(waited >= Duration::from_millis(50), "{waited:?}");
        assert!(waited < Duration::from_secs(60), "{waited:?}");
        assert_eq!(pool.overflowed(), 1);
        assert_eq!(pool.peak_workers(), 1);
        release_tx.send(()).unwrap();
        assert!(slow.join().unwrap().unwrap());
        // The husk of the job taken back is skipped; the worker still serves new jobs.
        assert_eq!(pool.run(Duration::from_secs(600), || 8).unwrap(), 8);
        assert_eq!(pool.overflowed(), 1);
    }

    #[test]
    fn a_panicking_job_panics_in_the_caller_and_the_worker_lives_on() {
        let pool = pool(1);
        let caught = catch_unwind(AssertUnwindSafe(|| {
            pool.run(Duration::from_secs(600), || -> u8 { panic!("job panics") })
        }));
        assert!(caught.is_err());
        assert_eq!(pool.run(Duration::from_secs(600), || 9).unwrap(), 9);
        assert_eq!(pool.peak_workers(), 1);
        assert_eq!(pool.workers(), 1);
    }

    #[test]
    fn an_idle_worker_ends_and_a_new_one_starts_on_demand() {
        let pool = Arc::new(ConnectPool::new(
            2,
            64 * 1024,
            "test-pool",
            Duration::from_millis(20),
        ));
        assert_eq!(pool.run(Duration::from_secs(600), || 1).unwrap(), 1);
        let deadline = Instant::now() + Duration::from_secs(60);
        while pool.workers() > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(pool.workers(), 0);
        assert_eq!(pool.run(Duration::from_secs(600), || 2).unwrap(), 2);
        assert_eq!(pool.overflowed(), 0);
    }

    #[test]
    fn remaining_time_is_zero_after_the_deadline() {
        assert_eq!(
            remaining(Instant::now() - Duration::from_secs(1)),
            Duration::ZERO
        );
        assert!(remaining(Instant::now() + Duration::from_secs(60)) > Duration::from_secs(50));
    }
}
