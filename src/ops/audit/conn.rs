//! One blocking connection of the audit: read a query's whole history page by page, reconcile
//! a filter with NIP-77, publish events and wait for their `OK`. Every wait has a deadline;
//! NIP-42 challenges are answered with the connection's key, if it has one.
//!
//! The daemon's relay threads are built for thousands of live subscriptions; the audit asks
//! one question at a time per relay, so a plain loop over `read` is enough here. What the
//! relay sends is checked as in the daemon: frames through [`parse_relay_frame`], events
//! through their filter, id and (for events the own relay lacks) signature, pages planned by
//! [`crate::core::paging::plan_pages`] through the connection's [`CapWatch`] (a relay that caps its answers below
//! the assumed page size without publishing it is probed and paged as the daemon pages it,
//! decision 0103).

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use nostr::event::{Event, EventId};
use nostr::filter::{Filter, MatchEventOptions};
use nostr::key::Keys;
use nostr::message::{ClientMessage, SubscriptionId};
use tungstenite::Message;

use crate::core::auth::auth_event;
use crate::core::dedup::EventSummary;
use crate::core::message::{
    escape_for_log, parse_event, parse_ok_frame, parse_relay_frame, Incoming,
};
use crate::core::paging::{CapWatch, PageLimits, PageStats};
use crate::core::relay_text::Prefix;
use crate::core::sync::Nip77Config;
use crate::core::{Clock, SystemClock};
use crate::net::ws::{self, Socket};
use crate::shared::RelayUrl;

/// Most ids asked for in one `ids` filter when fetching what a reconciliation found missing.
const IDS_PER_REQ: usize = 250;

/// How long to wait for the answer to our `AUTH` before a query refused with
/// `auth-required:` is given up.
const AUTH_WAIT: Duration = Duration::from_secs(10);

/// A connection, its key for NIP-42 and what it counted.
pub(super) struct Conn {
    pub(super) url: RelayUrl,
    socket: Socket,
    keys: Option<Keys>,
    next_sub: u64,
    /// The id of our `AUTH` event waiting for its `OK`.
    auth_pending: Option<EventId>,
    /// The relay accepted our `AUTH`.
    authed: bool,
    /// An `AUTH` was sent on this connection: later challenges are not signed (a relay could
    /// otherwise make us sign one per frame; issue 36).
    auth_sent: bool,
    /// Events the relay sent that failed a check (malformed, outside the filter, wrong id).
    pub(super) rejected: u64,
    /// Frames that could not be read.
    pub(super) bad_frames: u64,
    /// The relay's largest page and a cap learnt from it, over every query of the
    /// connection (decision 0103).
    pub(super) caps: CapWatch,
}

/// The own relay's answer to one published event: `Ok(true)` already there (`duplicate:`),
/// `Ok(false)` stored, `Err` refused or not answered (the reason).
pub(super) type Answer = (EventId, Result<bool, String>);

/// How a query ended when it did not end complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum QueryEnd {
    /// Every page read.
    Complete,
    /// Read as far as the relay allows; the reason part of the history could not be asked for.
    Incomplete(String),
}

impl Conn {
    pub(super) fn new(url: RelayUrl, socket: Socket, keys: Option<Keys>) -> Conn {
        Conn {
            url,
            socket,
            keys,
            next_sub: 0,
            auth_pending: None,
            authed: false,
            auth_sent: false,
            rejected: 0,
            bad_frames: 0,
            caps: CapWatch::default(),
        }
    }

    fn sub_id(&mut self, what: &str) -> SubscriptionId {
        self.next_sub += 1;
        SubscriptionId::new(format!("audit-{what}-{}", self.next_sub))
    }

    fn send(&mut self, text: String) -> Result<(), String> {
        self.socket
            .send(Message::text(text))
            .map_err(|e| format!("send failed: {e}"))
    }

    /// The next text frame that is not about NIP-42 (challenges are answered here), or
    /// `None` once `deadline` passed.
    fn next_frame(&mut self, deadline: Instant) -> Result<Option<String>, String> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            ws::set_tick(&self.socket, left.min(Duration::from_secs(1)))
                .map_err(|e| format!("socket: {e}"))?;
            let text = match self.socket.read() {
                Ok(Message::Text(t)) => t.to_string(),
                Ok(Message::Close(_)) => return Err("the relay closed the connection".into()),
                Ok(_) => continue,
                Err(e) if ws::is_timeout(&e) => continue,
                Err(e) => return Err(format!("connection lost: {e}")),
            };
            if self.take_auth(&text)? {
                continue;
            }
            return Ok(Some(text));
        }
    }

    /// Handles `AUTH` challenges and the `OK` of our `AUTH`; true when `text` was one.
    fn take_auth(&mut self, text: &str) -> Result<bool, String> {
        if let Some((id, accepted, message)) = parse_ok_frame(text) {
            if self.auth_pending == Some(id) {
                self.auth_pending = None;
                self.authed = accepted;
                if !accepted {
                    log::warn!(
                        "{}: AUTH refused: {}",
                        self.url,
                        escape_for_log(message, 200)
                    );
                }
                return Ok(true);
            }
            return Ok(false);
        }
        let Ok(Incoming::Auth(challenge)) = parse_relay_frame(text) else {
            return Ok(false);
        };
        let Some(keys) = self.keys.clone() else {
            log::debug!("{}: AUTH challenge, no key to answer it", self.url);
            return Ok(true);
        };
        if self.auth_sent {
            log::debug!(
                "{}: another AUTH challenge on this connection; answered once only",
                self.url
            );
            return Ok(true);
        }
        self.auth_sent = true;
        let (id, frame) = auth_event(&keys, &self.url, &challenge, SystemClock.now())?;
        self.auth_pending = Some(id);
        self.send(frame)?;
        Ok(true)
    }

    /// Waits until our `AUTH` was answered (or `AUTH_WAIT` passed); true when accepted.
    fn wait_for_auth(&mut self, deadline: Instant) -> Result<bool, String> {
        let until = deadline.min(Instant::now() + AUTH_WAIT);
        while self.auth_pending.is_some() && !self.authed {
            match self.next_frame(until)? {
                Some(text) => log::debug!(
                    "{}: frame while waiting for AUTH: {}",
                    self.url,
                    escape_for_log(&text, 120)
                ),
                None => break,
            }
        }
        Ok(self.authed)
    }

    /// Reads `filter`'s whole history, page by page ([`CapWatch::plan`]: [`crate::core::paging::plan_pages`] with
    /// what the relay has shown, `limits` being what it publishes), calling `on_event` with
    /// every event that matches its page's filter and carries its true id (the signature is
    /// left to the caller, which answers whether it trusts the event: only trusted events
    /// count for paging, so a relay cannot make us page on with forgeries). `page_timeout` bounds the wait for each page's `EOSE`; `deadline`
    /// the whole query.
    pub(super) fn read_history(
        &mut self,
        filter: &Filter,
        limits: &PageLimits,
        page_timeout: Duration,
        deadline: Instant,
        on_event: &mut dyn FnMut(Event) -> bool,
    ) -> Result<QueryEnd, String> {
        let mut first = filter.clone();
        if let (Some(max), None) = (limits.max_limit, first.limit) {
            first = first.limit(max);
        }
        let mut pages = VecDeque::from([first]);
        let mut end = QueryEnd::Complete;
        let mut auth_retried = false;
        let mut silent_pages = 0u32;
        while let Some(page) = pages.pop_front() {
            let sub = self.sub_id("req");
            self.send(ClientMessage::req(sub.clone(), page.clone()).as_json())?;
            let page_deadline = deadline.min(super::deadline_in(page_timeout));
            let mut stats = PageStats::default();
            loop {
                let Some(text) = self.next_frame(page_deadline)? else {
                    // nostr-rs-relay now and then drops a query's stored answer (no events,
                    // no EOSE; seen in tests/interop.rs): ask once more before giving up.
                    if silent_pages < 1 && Instant::now() < deadline {
                        silent_pages += 1;
                        log::info!(
                            "{}: no EOSE within {} s; asking again",
                            self.url,
                            page_timeout.as_secs()
                        );
                        self.send(ClientMessage::close(sub.clone()).as_json())?;
                        pages.push_front(page);
                        break;
                    }
                    return Err(format!(
                        "no EOSE within {} s for {}",
                        page_timeout.as_secs(),
                        escape_for_log(&page.as_json(), 200)
                    ));
                };
                let frame = match parse_relay_frame(&text) {
                    Ok(f) => f,
                    Err(e) => {
                        self.bad_frames += 1;
                        log::debug!("{}: unreadable frame ({e})", self.url);
                        continue;
                    }
                };
                match frame {
                    Incoming::Event { sub_id, raw } if sub_id == sub.as_str() => {
                        match parse_event(raw.get()) {
                            Ok(event)
                                if page.match_event(&event, MatchEventOptions::new())
                                    && event.verify_id() =>
                            {
                                let summary = EventSummary::of(&event);
                                if on_event(event) {
                                    stats.record_summary(&summary);
                                } else {
                                    stats.record_rejected();
                                }
                            }
                            _ => {
                                stats.record_rejected();
                                self.rejected += 1;
                            }
                        }
                    }
                    Incoming::Eose(id) if id == sub.as_str() => {
                        self.send(ClientMessage::close(sub.clone()).as_json())?;
                        let watched = self.caps.plan(&page, &stats, limits);
                        if let Some(cap) = watched.learned {
                            log::warn!(
                                "{}: returns at most {cap} events per query without publishing a limit; pages of {cap} are read as full",
                                self.url
                            );
                        }
                        let plan = watched.plan;
                        if let Some(why) = plan.incomplete {
                            end = QueryEnd::Incomplete(why);
                        }
                        pages.extend(plan.next);
                        break;
                    }
                    Incoming::Closed {
                        sub_id,
                        prefix,
                        message,
                    } if sub_id == sub.as_str() => {
                        if prefix == Prefix::AuthRequired
                            && !auth_retried
                            && self.wait_for_auth(deadline)?
                        {
                            auth_retried = true;
                            pages.push_front(page);
                            break;
                        }
                        return Err(format!(
                            "the relay closed the query: {}",
                            escape_for_log(&message, 200)
                        ));
                    }
                    Incoming::Notice(n) => {
                        log::debug!("{}: NOTICE {}", self.url, escape_for_log(&n, 200))
                    }
                    _ => {}
                }
            }
        }
        Ok(end)
    }

    /// Reconciles `filter` with NIP-77 against `own` (the own relay's `(created_at, id)` of
    /// the events matching it): the ids only the own relay holds and the ids only the relay
    /// holds. `Err` when the relay does not take part (NOTICE, CLOSED, NEG-ERR, silence) or
    /// breaks a bound of `cfg`; the caller then reads the query by REQ.
    pub(super) fn reconcile(
        &mut self,
        filter: &Filter,
        own: &[(u64, EventId)],
        cfg: &Nip77Config,
        deadline: Instant,
    ) -> Result<(Vec<EventId>, Vec<EventId>), String> {
        let (mut neg, first) = crate::core::sync::NegClient::new(own, cfg.frame_size)?;
        let sub = self.sub_id("neg");
        self.send(ClientMessage::neg_open(sub.clone(), filter.clone(), first).as_json())?;
        // Ids the own relay alone holds, each once (rounds may name an id again).
        let mut have: HashSet<EventId> = HashSet::default();
        let mut need = Vec::new();
        let mut rounds = 0u32;
        loop {
            let round_deadline = deadline.min(super::deadline_in(cfg.round_timeout));
            let Some(text) = self.next_frame(round_deadline)? else {
                return Err(format!(
                    "no NIP-77 answer within {} s",
                    cfg.round_timeout.as_secs()
                ));
            };
            let message = match parse_relay_frame(&text) {
                Ok(Incoming::NegMsg { sub_id, message }) if sub_id == sub.as_str() => message,
                Ok(Incoming::NegErr { sub_id, message }) if sub_id == sub.as_str() => {
                    return Err(format!("NEG-ERR {}", escape_for_log(&message, 200)))
                }
                Ok(Incoming::Closed {
                    sub_id, message, ..
                }) if sub_id == sub.as_str() => {
                    return Err(format!("CLOSED {}", escape_for_log(&message, 200)))
                }
                Ok(Incoming::Notice(n)) => {
                    return Err(format!("NOTICE {}", escape_for_log(&n, 200)))
                }
                _ => continue,
            };
            rounds += 1;
            if rounds > cfg.max_rounds {
                return Err(format!("still negotiating after {} rounds", cfg.max_rounds));
            }
            let mut ours = Vec::new();
            let next = neg.round(&message, Some(&mut ours), &mut need)?;
            have.extend(ours);
            if need.len() > cfg.max_need_ids {
                return Err(format!(
                    "the relay claims more than {} missing events",
                    cfg.max_need_ids
                ));
            }
            match next {
                Some(m) => self.send(
                    ClientMessage::NegMsg {
                        subscription_id: std::borrow::Cow::Owned(sub.clone()),
                        message: std::borrow::Cow::Owned(m),
                    }
                    .as_json(),
                )?,
                None => {
                    self.send(
                        ClientMessage::NegClose {
                            subscription_id: std::borrow::Cow::Owned(sub),
                        }
                        .as_json(),
                    )?;
                    return Ok((have.into_iter().collect(), need));
                }
            }
        }
    }

    /// Fetches the events `ids` (within `filter`) by `ids` queries; `on_event` gets each that
    /// matches, has its true id and was asked for, and answers whether it trusts it.
    pub(super) fn fetch_ids(
        &mut self,
        filter: &Filter,
        ids: &[EventId],
        limits: &PageLimits,
        page_timeout: Duration,
        deadline: Instant,
        on_event: &mut dyn FnMut(Event) -> bool,
    ) -> Result<QueryEnd, String> {
        let chunk = self
            .caps
            .limits(limits)
            .page_size
            .saturating_sub(1)
            .clamp(1, IDS_PER_REQ);
        let mut end = QueryEnd::Complete;
        for part in ids.chunks(chunk) {
            let wanted: HashSet<EventId> = part.iter().copied().collect();
            let query = filter.clone().ids(part.iter().copied());
            let mut keep = |e: Event| wanted.contains(&e.id) && on_event(e);
            if let QueryEnd::Incomplete(why) =
                self.read_history(&query, limits, page_timeout, deadline, &mut keep)?
            {
                end = QueryEnd::Incomplete(why);
            }
        }
        Ok(end)
    }

    /// Publishes `events` (raw JSON) with at most `window` waiting for their `OK`, answering
    /// `rate-limited:` and `error:` with a pause (the forwarder's [`error_pause`](crate::core::forward::error_pause): 1 s doubling, at most 60 s) and another
    /// try, up to `tries` tries per event. Returns per event whether the relay took it, and
    /// the reason when it did not.
    pub(super) fn publish(
        &mut self,
        events: &[(EventId, String)],
        window: usize,
        tries: u32,
        deadline: Instant,
    ) -> Result<Vec<Answer>, String> {
        let mut queue: VecDeque<(usize, u32)> = (0..events.len()).map(|i| (i, 0)).collect();
        let mut waiting: std::collections::HashMap<EventId, (usize, u32)> = Default::default();
        let mut out = Vec::with_capacity(events.len());
        let mut errors = 0u32;
        let mut resume = Instant::now();
        while !queue.is_empty() || !waiting.is_empty() {
            if Instant::now() >= deadline {
                for (i, _) in queue.drain(..).chain(waiting.drain().map(|(_, v)| v)) {
                    out.push((events[i].0, Err("not answered before the deadline".into())));
                }
                break;
            }
            while waiting.len() < window && Instant::now() >= resume {
                let Some((i, tried)) = queue.pop_front() else {
                    break;
                };
                let (id, raw) = &events[i];
                self.send(format!("[\"EVENT\",{raw}]"))?;
                waiting.insert(*id, (i, tried + 1));
            }
            let wait_until = if waiting.is_empty() {
                resume.min(deadline)
            } else {
                deadline.min(Instant::now() + Duration::from_secs(30))
            };
            let Some(text) = self.next_frame(wait_until)? else {
                if !waiting.is_empty() && Instant::now() < deadline {
                    // 30 s without an answer: the relay dropped them; ask again.
                    for (_, (i, tried)) in waiting.drain() {
                        queue.push_back((i, tried));
                    }
                }
                continue;
            };
            let Some((id, accepted, message)) = parse_ok_frame(&text) else {
                continue;
            };
            let Some((i, tried)) = waiting.remove(&id) else {
                continue;
            };
            let prefix = Prefix::of(message);
            let transient = matches!(
                prefix,
                Prefix::RateLimited | Prefix::Error | Prefix::AuthRequired
            );
            if accepted || prefix == Prefix::Duplicate {
                errors = 0;
                out.push((id, Ok(prefix == Prefix::Duplicate)));
            } else if transient && tried < tries {
                if prefix == Prefix::AuthRequired {
                    self.wait_for_auth(deadline)?;
                } else {
                    // The forwarder's pause: 1 s doubling per answer in a row, at most 60 s.
                    errors += 1;
                    let pause = crate::core::forward::error_pause(Duration::from_secs(1), errors);
                    resume = super::deadline_in(pause);
                    log::info!(
                        "{}: {}; next event in {} s",
                        self.url,
                        escape_for_log(message, 120),
                        pause.as_secs()
                    );
                }
                queue.push_front((i, tried));
            } else {
                out.push((id, Err(escape_for_log(message, 200))));
            }
        }
        Ok(out)
    }
}
