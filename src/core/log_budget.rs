//! A small rate limiter for the log lines a remote relay can provoke at will.
//!
//! A relay that sends ten thousand events that do not match their subscription, or an AUTH
//! challenge in a loop, must not write ten thousand lines at info level. Each session keeps a
//! [`LogBudget`]: per kind of line, the first [`LogBudget::per_window`] lines of a window
//! ([`LogBudget::window`], a minute by default) go out at their level, the rest at debug
//! level; when the window ends, one summary line says how many were demoted. The counters the
//! lines go with (for example `events_unmatched`) keep counting every occurrence.
//!
//! Sans-IO: the time is the `now` the caller was given.

use std::time::Duration;

use crate::core::time::Time;

/// Default length of a budget window.
pub(crate) const LOG_WINDOW: Duration = Duration::from_secs(60);

/// Default lines of one kind logged at their level per window.
pub(crate) const LOG_LINES_PER_WINDOW: u32 = 5;

/// One kind of line: its window and what happened in it.
#[derive(Debug, Clone, Copy)]
struct Slot {
    kind: &'static str,
    start: Time,
    logged: u32,
    demoted: u64,
}

/// Per-kind budgets of log lines (see the module documentation).
#[derive(Debug, Clone)]
pub struct LogBudget {
    window: Duration,
    per_window: u32,
    slots: Vec<Slot>,
    /// Windows that ended with demoted lines, not yet summarised.
    ended: Vec<(&'static str, u64)>,
    logged: u64,
    demoted: u64,
}

impl Default for LogBudget {
    fn default() -> Self {
        LogBudget::new(LOG_WINDOW, LOG_LINES_PER_WINDOW)
    }
}

impl LogBudget {
    /// A budget of `per_window` lines of each kind per `window`.
    #[must_use]
    pub fn new(window: Duration, per_window: u32) -> LogBudget {
        LogBudget {
            window,
            per_window,
            slots: Vec::new(),
            ended: Vec::new(),
            logged: 0,
            demoted: 0,
        }
    }

    /// The window length.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Lines of one kind logged at their level per window.
    pub fn per_window(&self) -> u32 {
        self.per_window
    }

    /// Whether a line of `kind` at `now` may go out at its level (true) or is demoted to
    /// debug level (false; counted, and summarised when its window ends).
    pub fn allow(&mut self, now: Time, kind: &'static str) -> bool {
        let i = match self.slots.iter().position(|s| s.kind == kind) {
            Some(i) => i,
            None => {
                self.slots.push(Slot {
                    kind,
                    start: now,
                    logged: 0,
                    demoted: 0,
                });
                self.slots.len() - 1
            }
        };
        let slot = &mut self.slots[i];
        if now.since(slot.start) >= self.window {
            if slot.demoted > 0 {
                self.ended.push((kind, slot.demoted));
            }
            *slot = Slot {
                kind,
                start: now,
                logged: 0,
                demoted: 0,
            };
        }
        if slot.logged < self.per_window {
            slot.logged += 1;
            self.logged += 1;
            true
        } else {
            slot.demoted += 1;
            self.demoted += 1;
            false
        }
    }

    /// Calls `summary(kind, demoted)` for every window that has ended by `now` with demoted
    /// lines (each once), so the caller logs "N lines suppressed". Allocates nothing when
    /// there is nothing to say.
    pub fn summaries(&mut self, now: Time, mut summary: impl FnMut(&'static str, u64)) {
        for (kind, n) in self.ended.drain(..) {
            summary(kind, n);
        }
        for slot in &mut self.slots {
            if slot.demoted > 0 && now.since(slot.start) >= self.window {
                summary(slot.kind, slot.demoted);
                slot.demoted = 0;
            }
        }
    }

    /// Lines logged at their level so far (all kinds).
    pub fn logged(&self) -> u64 {
        self.logged
    }

    /// Lines demoted to debug level so far (all kinds).
    pub fn demoted(&self) -> u64 {
        self.demoted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> Time {
        Time::from_secs(1_000 + secs)
    }

    #[test]
    fn the_first_lines_of_a_window_pass_the_rest_are_demoted_and_summarised_once() {
        let mut b = LogBudget::new(Duration::from_secs(60), 3);
        let passed = (0..1000).filter(|_| b.allow(t(0), "a")).count();
        assert_eq!(passed, 3);
        // Another kind has its own budget.
        assert!(b.allow(t(1), "b"));
        let mut said = Vec::new();
        b.summaries(t(59), |k, n| said.push((k, n)));
        assert!(said.is_empty(), "the window has not ended");
        b.summaries(t(60), |k, n| said.push((k, n)));
        assert_eq!(said, [("a", 997)]);
        b.summaries(t(61), |k, n| said.push((k, n)));
        assert_eq!(said.len(), 1, "summarised once");
        // A new window: lines pass again.
        assert!(b.allow(t(61), "a"));
        assert_eq!((b.logged(), b.demoted()), (5, 997));
    }

    #[test]
    fn a_window_rolled_by_a_new_line_keeps_its_summary() {
        let mut b = LogBudget::new(Duration::from_secs(60), 1);
        assert!(b.allow(t(0), "a"));
        assert!(!b.allow(t(1), "a"));
        assert!(b.allow(t(100), "a"), "the next window");
        let mut said = Vec::new();
        b.summaries(t(100), |k, n| said.push((k, n)));
        assert_eq!(said, [("a", 1)]);
    }
}
