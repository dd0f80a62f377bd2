//! The relay thread's blocking hand-overs: reports to the coordinator and checked events to
//! the forwarder. Each waits with a deadline per attempt so that a stopping engine ends it,
//! and a relay thread waiting for the forward pipeline still pings its relay.

use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{SendTimeoutError, Sender};
use log::debug;
use tungstenite::Message;

use crate::core::keepalive::BlockedPinger;
use crate::core::session::RelaySession;
use crate::core::sync::Report;
use crate::engine::connection::ConnectionThread;
use crate::engine::forwarder::ForwardItem;
use crate::engine::metrics::{ByteAdmission, RelayCounters};
use crate::engine::Input;
use crate::net::ws::Socket;

impl ConnectionThread {
    /// Hands the session's reports to the coordinator. False when the engine is stopping.
    pub(super) fn send_reports(&self, session: &mut RelaySession) -> bool {
        while let Some(report) = session.poll_report() {
            if !self.report(report) {
                return false;
            }
        }
        true
    }

    fn stalled(&self, generation: u64, active: bool) -> Report {
        Report::RelayStalled {
            relay: self.url.clone(),
            generation,
            active,
        }
    }

    fn report(&self, r: Report) -> bool {
        // The coordinator never waits on relay threads, so this cannot deadlock; the timeout
        // loop only lets a stopping engine end the thread.
        let mut msg = Input::Report(r);
        loop {
            match self.reports.send_timeout(msg, Duration::from_millis(200)) {
                Ok(()) => return true,
                Err(SendTimeoutError::Timeout(m)) => {
                    if self.stopping() {
                        return false;
                    }
                    msg = m;
                }
                Err(SendTimeoutError::Disconnected(_)) => return false,
            }
        }
    }

    /// Hands an event to the forwarder, waiting while its queue is full (back-pressure:
    /// this relay is not read meanwhile). Returns false when the engine is stopping.
    ///
    /// While it waits, the relay still gets a ping every ping interval, so a relay that cuts
    /// idle connections does not drop us during a long own-relay outage.
    pub(super) fn forward(
        &self,
        forward: &Sender<ForwardItem>,
        mut item: ForwardItem,
        socket: &mut Socket,
        generation: u64,
    ) -> bool {
        let mut pinger = BlockedPinger::new(self.ping_interval);
        // The byte bound: wait (pinging) until the event fits the pipeline and our share.
        let len = item.raw.len() as u64;
        let mut waited = false;
        while item.admission.is_none() {
            item.admission =
                ByteAdmission::try_take(&self.metrics, &self.counters, &self.forward_limits, len);
            if item.admission.is_some() {
                break;
            }
            if !waited {
                waited = true;
                RelayCounters::inc(&self.counters.forward_byte_waits);
                debug!("{}: forward pipeline byte bound reached; waiting", self.url);
                // Back-pressure like a full queue: this relay is not read meanwhile, so its
                // EOSE deadlines must not count.
                if !self.report(self.stalled(generation, true)) {
                    return false;
                }
            }
            if self.stopping() {
                return false;
            }
            self.ping_if_due(socket, &mut pinger);
            std::thread::sleep(Duration::from_millis(10));
        }
        if waited && !self.report(self.stalled(generation, false)) {
            return false;
        }
        let unresolved = &self.metrics.forward.unresolved;
        unresolved.fetch_add(1, Ordering::Relaxed);
        loop {
            match forward.send_timeout(item, Duration::from_millis(200)) {
                Ok(()) => return true,
                Err(SendTimeoutError::Timeout(i)) => {
                    if self.stopping() {
                        unresolved.fetch_sub(1, Ordering::Relaxed);
                        return false;
                    }
                    self.ping_if_due(socket, &mut pinger);
                    item = i;
                }
                Err(SendTimeoutError::Disconnected(_)) => {
                    unresolved.fetch_sub(1, Ordering::Relaxed);
                    return false;
                }
            }
        }
    }

    /// Pings the relay while this thread waits to hand over an event (the clock is read only
    /// when the hand-over has to wait, not per event).
    fn ping_if_due(&self, socket: &mut Socket, pinger: &mut BlockedPinger) {
        if pinger.due(self.clock.now()) {
            // A failed write shows up as an error on the next read.
            let _ = socket.write(Message::Ping(Vec::new().into()));
            let _ = socket.flush();
        }
    }
}
