//! Pure renderers of a [`Status`]: Prometheus text exposition, the `/status` JSON document,
//! the HTML status page and the plain-text table of `grasp-sync status`.
//!
//! Labels carry only normalised relay URLs (bounded by the relay cap) and fixed words, never
//! free text from relays.

use std::fmt::Write as _;

use serde_json::{json, Value};

use crate::core::health::HealthState;
use crate::core::progress::{Eta, Progress, RelayProgress};
use crate::core::state::ConnectionStatus;
use crate::engine::{RelayStatus, Status};

/// The version of the `/status` document; bumped when a field changes meaning or goes away.
pub const STATUS_SCHEMA_VERSION: u64 = 1;

fn connection_word(c: ConnectionStatus) -> &'static str {
    match c {
        ConnectionStatus::Connected => "connected",
        ConnectionStatus::Connecting => "connecting",
        ConnectionStatus::Disconnected => "disconnected",
    }
}

fn health_word(h: HealthState) -> &'static str {
    match h {
        HealthState::Healthy => "healthy",
        HealthState::Degraded => "degraded",
        HealthState::Dead => "dead",
    }
}

/// Escapes a Prometheus label value (backslash, double quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Reads one per-relay counter.
type RelayCounter = fn(&RelayStatus) -> u64;

struct Prom {
    out: String,
}

impl Prom {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP grasp_sync_{name} {help}");
        let _ = writeln!(self.out, "# TYPE grasp_sync_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let _ = write!(self.out, "grasp_sync_{name}");
        if !labels.is_empty() {
            let inner: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
                .collect();
            let _ = write!(self.out, "{{{}}}", inner.join(","));
        }
        let _ = writeln!(self.out, " {value}");
    }

    /// One family with one unlabelled sample.
    fn single(&mut self, name: &str, kind: &str, help: &str, value: impl std::fmt::Display) {
        self.family(name, kind, help);
        self.sample(name, &[], value);
    }

    /// One family with one sample per relay.
    fn per_relay(
        &mut self,
        status: &Status,
        name: &str,
        kind: &str,
        help: &str,
        value: impl Fn(&RelayStatus) -> u64,
    ) {
        self.family(name, kind, help);
        for r in &status.relays {
            self.sample(name, &[("relay", r.url.as_str())], value(r));
        }
    }
}

/// Appends the HTTP listener's own counters to a Prometheus text (see [`crate::ops::http`]).
pub fn prometheus_http(out: &mut String, counters: &crate::ops::http::HttpCounters) {
    use std::sync::atomic::Ordering;
    let mut p = Prom {
        out: std::mem::take(out),
    };
    p.family(
        "http_refused_total",
        "counter",
        "Connections to this listener refused with 503, by reason (busy: every slot taken; client: the client address held its share).",
    );
    p.sample(
        "http_refused_total",
        &[("reason", "busy")],
        counters.refused_busy.load(Ordering::Relaxed),
    );
    p.sample(
        "http_refused_total",
        &[("reason", "client")],
        counters.refused_client.load(Ordering::Relaxed),
    );
    p.single(
        "http_cut_total",
        "counter",
        "Connections to this listener closed at a deadline (request head or answer not in time).",
        counters.cut.load(Ordering::Relaxed),
    );
    *out = p.out;
}

/// The Prometheus text exposition format (version 0.0.4) of `status`.
pub fn prometheus(status: &Status) -> String {
    let mut p = Prom { out: String::new() };
    p.family("build_info", "gauge", "Version of the running grasp-sync.");
    p.sample("build_info", &[("version", env!("CARGO_PKG_VERSION"))], 1);
    p.single(
        "own_relay_connected",
        "gauge",
        "1 while the self-subscription is connected to the own relay.",
        u8::from(status.own_relay == ConnectionStatus::Connected),
    );
    p.single(
        "forwarder_connected",
        "gauge",
        "1 while the forwarder is connected to the own relay.",
        u8::from(status.forwarder_connected),
    );
    p.single(
        "repositories",
        "gauge",
        "Repositories in the index.",
        status.repos,
    );
    p.single(
        "root_events",
        "gauge",
        "Distinct root events in the index.",
        status.root_events,
    );
    p.single(
        "thread_events",
        "gauge",
        "Replies followed below the root events (their ids are Layer-3 tag values).",
        status.thread_events,
    );
    p.family(
        "relay_connected",
        "gauge",
        "1 while the remote relay is connected.",
    );
    for r in &status.relays {
        p.sample(
            "relay_connected",
            &[("relay", r.url.as_str())],
            u8::from(r.connection_status == ConnectionStatus::Connected),
        );
    }
    p.family(
        "relay_health",
        "gauge",
        "Health of the remote relay: 1 for its current state.",
    );
    for r in &status.relays {
        for h in [
            HealthState::Healthy,
            HealthState::Degraded,
            HealthState::Dead,
        ] {
            p.sample(
                "relay_health",
                &[("relay", r.url.as_str()), ("state", health_word(h))],
                u8::from(r.health == h),
            );
        }
    }
    p.per_relay(
        status,
        "relay_open_subscriptions",
        "gauge",
        "Open subscriptions on the relay.",
        |r| r.open_subscriptions as u64,
    );
    p.per_relay(
        status,
        "relay_queued_queries",
        "gauge",
        "Queries waiting for room in the relay's subscription budget.",
        |r| r.queued_queries as u64,
    );
    p.per_relay(
        status,
        "relay_nip77",
        "gauge",
        "1 while history from the relay is reconciled by NIP-77 (advertised or worked).",
        |r| u64::from(r.nip77.in_use()),
    );
    for (name, help, repos, roots) in [
        (
            "relay_target_items",
            "Repositories and Layer-3 ids (root events and the replies followed below them) the relay should carry.",
            (|r: &RelayStatus| r.target_repos) as fn(&RelayStatus) -> usize,
            (|r: &RelayStatus| r.target_root_events) as fn(&RelayStatus) -> usize,
        ),
        (
            "relay_confirmed_items",
            "Repositories and root events whose history the relay delivered (EOSE).",
            |r: &RelayStatus| r.confirmed_repos,
            |r: &RelayStatus| r.confirmed_root_events,
        ),
        (
            "relay_pending_items",
            "Repositories and root events in batches waiting for EOSE.",
            |r: &RelayStatus| r.pending_repos,
            |r: &RelayStatus| r.pending_root_events,
        ),
    ] {
        p.family(name, "gauge", help);
        for r in &status.relays {
            let url = r.url.as_str();
            p.sample(name, &[("relay", url), ("kind", "repository")], repos(r));
            p.sample(name, &[("relay", url), ("kind", "root_event")], roots(r));
        }
    }
    let counters: [(&str, &str, RelayCounter); 14] = [
        (
            "relay_failed_batches_total",
            "Batches of the relay that failed (EOSE deadline, CLOSED, disconnect).",
            |r| r.failed_batches,
        ),
        (
            "relay_incomplete_queries_total",
            "Queries whose history the relay could not deliver completely.",
            |r| r.incomplete_queries,
        ),
        (
            "relay_ids_undelivered_total",
            "Ids the relay listed for a reconciled query and did not deliver when asked by id twice.",
            |r| r.ids_undelivered,
        ),
        (
            "relay_connects_total",
            "Connections to the relay established.",
            |r| r.connects,
        ),
        (
            "relay_disconnects_total",
            "Connections to the relay lost or failed (reconnects).",
            |r| r.disconnects,
        ),
        (
            "relay_events_received_total",
            "EVENT messages received from the relay.",
            |r| r.events_received,
        ),
        (
            "relay_events_accepted_total",
            "Events from the relay that passed every check.",
            |r| r.events_accepted,
        ),
        (
            "relay_events_invalid_total",
            "Events from the relay with a bad id or signature, or malformed.",
            |r| r.events_invalid,
        ),
        (
            "relay_events_unmatched_total",
            "Events from the relay that did not match their subscription.",
            |r| r.events_unmatched,
        ),
        (
            "relay_signature_checks_total",
            "Schnorr signature checks done for the relay's events (copies of events verified before skip it).",
            |r| r.signature_checks,
        ),
        (
            "relay_copies_not_forwarded_total",
            "Events from the relay not handed to the forwarder because a copy already was.",
            |r| r.copies_not_forwarded,
        ),
        (
            "relay_fetch_ids_in_flight_total",
            "Ids a reconciliation's fetch did not ask the relay for because a copy was on its way to the own relay.",
            |r| r.fetch_ids_in_flight,
        ),
        (
            "relay_notices_total",
            "NOTICE messages from the relay.",
            |r| r.notices,
        ),
        (
            "relay_closed_total",
            "CLOSED messages from the relay.",
            |r| r.closed,
        ),
    ];
    for (name, help, f) in counters {
        p.per_relay(status, name, "counter", help, f);
    }
    p.single(
        "events_forwarded_total",
        "counter",
        "Events the own relay stored.",
        status.forwarded,
    );
    p.single(
        "events_duplicate_total",
        "counter",
        "Events the own relay already had.",
        status.duplicates,
    );
    p.family(
        "events_rejected_total",
        "counter",
        "Events the own relay rejected, by the prefix of its reason.",
    );
    for (reason, n) in &status.rejected_by_reason {
        p.sample("events_rejected_total", &[("reason", reason)], n);
    }
    p.single(
        "events_invalid_total",
        "counter",
        "Events dropped for a bad id or signature, or malformed (all relays).",
        status.invalid,
    );
    p.family(
        "events_unmatched_total",
        "counter",
        "Events dropped before forwarding, by cause.",
    );
    let unknown_sub: u64 = status
        .relays
        .iter()
        .map(|r| r.events_unknown_subscription)
        .sum();
    p.sample(
        "events_unmatched_total",
        &[("cause", "filter")],
        status.unmatched,
    );
    p.sample(
        "events_unmatched_total",
        &[("cause", "unknown_subscription")],
        unknown_sub,
    );
    let c = &status.sync;
    p.family(
        "closed_total",
        "counter",
        "CLOSED messages from remote relays handled by the sync logic, by kind.",
    );
    p.sample(
        "closed_total",
        &[("kind", "rate_limited")],
        c.closed_rate_limited,
    );
    p.sample(
        "closed_total",
        &[("kind", "auth_required")],
        c.closed_auth_required,
    );
    p.sample("closed_total", &[("kind", "refused")], c.closed_refused);
    p.family(
        "notices_total",
        "counter",
        "NOTICE messages from remote relays, by kind.",
    );
    p.sample(
        "notices_total",
        &[("kind", "rate_limit")],
        c.notices_rate_limit,
    );
    p.sample("notices_total", &[("kind", "other")], c.notices_other);
    p.family(
        "reconcile_fallbacks_total",
        "counter",
        "NIP-77 reconciliations that gave way to paged REQs, by reason.",
    );
    for r in crate::core::sync::FallbackReason::ALL {
        p.sample(
            "reconcile_fallbacks_total",
            &[("reason", r.label())],
            c.fallbacks(r),
        );
    }
    p.family(
        "replies_not_followed_total",
        "counter",
        "Related replies whose own replies are not followed, by the bound that stopped them (depth: --reply-depth, thread: --thread-size, cap: --max-thread-ids, waiting: the waiting set was full).",
    );
    for (reason, v) in [
        ("depth", c.replies_beyond_depth),
        ("thread", c.replies_thread_full),
        ("cap", c.replies_cap_reached),
        ("waiting", c.replies_waiting_dropped),
    ] {
        p.sample("replies_not_followed_total", &[("reason", reason)], v);
    }
    for (name, help, v) in [
        (
            "batches_confirmed_total",
            "Batches confirmed (every query saw EOSE).",
            c.batches_confirmed,
        ),
        (
            "batches_failed_total",
            "Batches failed (EOSE deadline, CLOSED, disconnect).",
            c.batches_failed,
        ),
        (
            "pages_requested_total",
            "Pages of older history requested from capped relays.",
            c.pages_requested,
        ),
        (
            "cap_probes_total",
            "Short pages of relays publishing no limits asked once more, in case the relay caps below the assumed page size.",
            c.cap_probes,
        ),
        (
            "caps_learned_total",
            "Relays caught capping their answers below the assumed page size without publishing it.",
            c.caps_learned,
        ),
        (
            "queries_resent_total",
            "Queries sent again because no EOSE came in time.",
            c.queries_resent,
        ),
        (
            "queries_resumed_total",
            "History queries continued after a quick reconnect.",
            c.queries_resumed,
        ),
        (
            "consolidations_total",
            "Consolidations and live-set rebuilds.",
            c.consolidations,
        ),
        (
            "daily_resyncs_total",
            "Daily full resyncs (one per relay each time).",
            c.daily_resyncs,
        ),
        (
            "relays_refused_total",
            "Relays not connected because a cap was reached.",
            c.relays_refused,
        ),
        (
            "relays_excluded_total",
            "Relays refused by the address policy, never targets again.",
            c.relays_excluded,
        ),
        (
            "hosts_excluded_total",
            "Hosts (and ports) excluded whole after too many refused URLs.",
            c.hosts_excluded,
        ),
        (
            "pubkeys_blocked_total",
            "Announcing pubkeys blocked after naming too many refused relays.",
            c.pubkeys_blocked,
        ),
        (
            "selections_total",
            "Selections run for refused or failing relays and first root events while a cap binds.",
            c.selections,
        ),
        (
            "announcement_relays_dropped_total",
            "Relays named by announcements beyond the per-announcement cap, ignored.",
            c.announcement_relays_dropped,
        ),
        (
            "reconciliations_total",
            "NIP-77 reconciliations completed.",
            c.reconciliations,
        ),
        (
            "reconcile_ids_fetched_total",
            "Events asked for by id because a reconciliation found the own relay lacks them.",
            c.reconcile_ids_fetched,
        ),
        (
            "neg_unknown_total",
            "NIP-77 messages for no running negentropy session, dropped.",
            c.neg_unknown,
        ),
        (
            "nip77_detections_total",
            "NEG-OPENs sent beside the REQ path to find out whether a relay speaks NIP-77.",
            c.nip77_detections,
        ),
        (
            "reconcile_skipped_empty_total",
            "History queries sent as one REQ instead of a reconciliation: the own relay held nothing for them.",
            c.reconcile_skipped_empty,
        ),
        (
            "own_reads_skipped_total",
            "History queries sent as one REQ without reading the own relay's side: no event it holds tags their values.",
            c.own_reads_skipped,
        ),
        (
            "fetch_ids_retried_total",
            "Ids a reconciliation's fetch asked for again because its first REQ ended without them.",
            c.fetch_ids_retried,
        ),
        (
            "fetch_ids_undelivered_total",
            "Ids relays listed for a query and did not deliver when asked by id twice.",
            c.fetch_ids_undelivered,
        ),
        (
            "own_thread_rereads_total",
            "Extra reads of the own relay's events for replies read before their parents.",
            c.own_thread_rereads,
        ),
        (
            "forward_resent_total",
            "Events the forwarder sent to the own relay again.",
            status.forward_resent,
        ),
        (
            "forward_relay_errors_total",
            "OK false \"error:\" answers of the own relay (the event is sent again, never given up).",
            status.forward_relay_errors,
        ),
        (
            "forward_set_aside_total",
            "Events set aside after repeated OK false \"error:\" answers (sent again every 10 minutes).",
            status.forward_set_aside,
        ),
        (
            "forward_aside_overflow_total",
            "Events set aside that moved to the rejected store because the aside set was full.",
            status.forward_aside_overflow,
        ),
        (
            "forward_rate_limited_total",
            "OK false \"rate-limited:\" answers of the own relay (the event is sent again, paced).",
            status.forward_rate_limited,
        ),
        (
            "forward_purgatory_total",
            "OK true \"purgatory:\" answers of the own relay (accepted, served once its git data arrives; never sent again).",
            status.forward_purgatory,
        ),
    ] {
        p.single(name, "counter", help, v);
    }
    p.single(
        "forward_queue_depth",
        "gauge",
        "Events queued or in flight in the forwarder.",
        status.forward_queue_depth,
    );
    p.single(
        "forward_aside",
        "gauge",
        "Events set aside after repeated OK false \"error:\" answers, waiting for their next try.",
        status.forward_aside,
    );
    p.single(
        "forward_pace_seconds",
        "gauge",
        "Interval between sends while the own relay rate-limits writes (0: not paced).",
        status.forward_pace_ms as f64 / 1000.0,
    );
    p.single(
        "forward_backlog",
        "gauge",
        "Events handed to the forwarder and not yet answered by the own relay.",
        status.forward_backlog,
    );
    let st = &status.state_file;
    p.single(
        "state_file_loaded",
        "gauge",
        "1 when the state file (--state-dir) read at start was used.",
        u8::from(st.loaded),
    );
    p.family(
        "state_file_ignored_total",
        "counter",
        "State files not used at start, by reason.",
    );
    for (reason, n) in &st.ignored_by_reason {
        p.sample("state_file_ignored_total", &[("reason", reason)], n);
    }
    p.single(
        "state_relays_restored",
        "gauge",
        "Relays restored from the state file for a quick reconnect at start.",
        st.relays_restored,
    );
    p.single(
        "state_saves_total",
        "counter",
        "State files written.",
        st.saves,
    );
    p.single(
        "state_save_failures_total",
        "counter",
        "State file writes that failed.",
        st.save_failures,
    );
    p.single(
        "state_last_save_timestamp_seconds",
        "gauge",
        "Unix time of the last state file written (0: none).",
        st.last_save_ms.unwrap_or(0) as f64 / 1000.0,
    );
    let l = &status.ok_latency;
    p.family(
        "ok_latency_seconds",
        "histogram",
        "Time from sending an event to the own relay's OK.",
    );
    for (i, n) in l.cumulative.iter().enumerate() {
        let le = l
            .bounds_ms
            .get(i)
            .map_or("+Inf".to_string(), |ms| format!("{}", *ms as f64 / 1000.0));
        p.sample("ok_latency_seconds_bucket", &[("le", &le)], n);
    }
    p.sample("ok_latency_seconds_sum", &[], l.sum_secs);
    p.sample("ok_latency_seconds_count", &[], l.count);
    p.out
}

/// A rate rounded to two decimals (`null`: less than [`crate::core::progress::MIN_SPAN`]
/// measured).
fn rate(r: Option<f64>) -> Value {
    r.map_or(Value::Null, |r| json!((r * 100.0).round() / 100.0))
}

/// The estimate's fields of a `progress` object: `eta_seconds` (0 when settled, `null` when
/// unknown), `eta_unknown` (why, or `null`) and `eta` (for people).
fn eta_fields(eta: &Eta, into: &mut serde_json::Map<String, Value>) {
    into.insert("eta_seconds".into(), json!(eta.seconds()));
    into.insert(
        "eta_unknown".into(),
        json!(eta.unknown().map(ToString::to_string)),
    );
    into.insert("eta".into(), json!(eta.to_string()));
}

/// The `progress` object of a relay in `/status`.
fn relay_progress_json(p: &RelayProgress) -> Value {
    let mut o = serde_json::Map::new();
    o.insert("settled".into(), json!(p.eta == Eta::Settled));
    o.insert(
        "history_queries_pending".into(),
        json!(p.history_queries_pending),
    );
    o.insert(
        "history_queries_completed".into(),
        json!(p.history_queries_completed),
    );
    o.insert(
        "history_queries_per_second".into(),
        rate(p.queries_per_second),
    );
    o.insert(
        "events_forwarded_per_second".into(),
        rate(p.events_forwarded_per_second),
    );
    eta_fields(&p.eta, &mut o);
    Value::Object(o)
}

/// The top-level `progress` object of `/status`.
fn progress_json(p: &Progress) -> Value {
    let mut o = serde_json::Map::new();
    o.insert(
        "repositories".into(),
        json!({"confirmed": p.confirmed_repos, "target": p.target_repos}),
    );
    o.insert(
        "root_events".into(),
        json!({"confirmed": p.confirmed_root_events, "target": p.target_root_events}),
    );
    o.insert(
        "history_queries_pending".into(),
        json!(p.history_queries_pending),
    );
    o.insert(
        "events_forwarded_per_second".into(),
        rate(p.events_forwarded_per_second),
    );
    o.insert("relays_settled".into(), json!(p.relays_settled));
    o.insert(
        "relays_without_estimate".into(),
        json!(p.relays_without_estimate),
    );
    eta_fields(&p.eta, &mut o);
    Value::Object(o)
}

/// The `/status` JSON document.
pub fn status_json(status: &Status) -> Value {
    let relays: Vec<Value> = status
        .relays
        .iter()
        .map(|r| {
            json!({
                "url": r.url.as_str(),
                "connection": connection_word(r.connection_status),
                "health": health_word(r.health),
                "bootstrap": r.is_bootstrap,
                "last_connected": r.last_connected.map(|t| t.timestamp().as_secs()),
                "last_error": r.last_error,
                "catch_up_since": r.catch_up_since,
                "open_subscriptions": r.open_subscriptions,
                "queued_queries": r.queued_queries,
                "polled_queries": r.polled_queries,
                "reopen_pending": r.reopen_pending,
                "nip77": r.nip77.word(),
                "reconciliations_pending": r.reconciliations_pending,
                "target": {"repositories": r.target_repos, "root_events": r.target_root_events},
                "confirmed": {"repositories": r.confirmed_repos, "root_events": r.confirmed_root_events},
                "pending": {"batches": r.pending_batches, "repositories": r.pending_repos, "root_events": r.pending_root_events},
                "failed_batches": r.failed_batches,
                "incomplete_queries": r.incomplete_queries,
                "ids_undelivered": r.ids_undelivered,
                "history_short": r.history_short,
                "learned_cap": r.learned_cap,
                "events": {
                    "received": r.events_received,
                    "accepted": r.events_accepted,
                    "invalid": r.events_invalid,
                    "unmatched": r.events_unmatched,
                    "unknown_subscription": r.events_unknown_subscription,
                    "signature_checks": r.signature_checks,
                    "copies_not_forwarded": r.copies_not_forwarded,
                    "fetch_ids_in_flight": r.fetch_ids_in_flight,
                },
                "notices": r.notices,
                "closed": r.closed,
                "garbage_frames": r.garbage_frames,
                "auth_challenges": r.auth_challenges,
                "connects": r.connects,
                "disconnects": r.disconnects,
                "progress": relay_progress_json(&r.progress),
            })
        })
        .collect();
    let rejected: serde_json::Map<String, Value> = status
        .rejected_by_reason
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
    let c = &status.sync;
    json!({
        "schema": STATUS_SCHEMA_VERSION,
        "version": env!("CARGO_PKG_VERSION"),
        "settled": status.is_settled(),
        "own_relay": connection_word(status.own_relay),
        "forwarder_connected": status.forwarder_connected,
        "self_sync_pending": status.self_sync_pending,
        "repositories": status.repos,
        "root_events": status.root_events,
        "thread_events": status.thread_events,
        "progress": progress_json(&status.progress),
        "forward": {
            "stored": status.forwarded,
            "duplicates": status.duplicates,
            "rejected": status.rejected,
            "rejected_by_reason": rejected,
            "backlog": status.forward_backlog,
            "queue_depth": status.forward_queue_depth,
            "resent": status.forward_resent,
            "relay_errors": status.forward_relay_errors,
            "rate_limited": status.forward_rate_limited,
            "purgatory": status.forward_purgatory,
            "set_aside": status.forward_set_aside,
            "aside": status.forward_aside,
            "aside_overflow": status.forward_aside_overflow,
            "pace_ms": status.forward_pace_ms,
            "ok_latency_count": status.ok_latency.count,
            "ok_latency_sum_seconds": status.ok_latency.sum_secs,
        },
        "invalid": status.invalid,
        "unmatched": status.unmatched,
        "selection": {
            "repos_in_scope": status.targets.repos_in_scope,
            "repos_out_of_scope": status.targets.repos_out_of_scope,
            "repos_blocked": status.targets.repos_blocked,
            "relays_wanted": status.targets.relays_wanted,
            "relays_selected": status.targets.relays_selected,
            "relays_over_pubkey_quota": status.targets.relays_over_pubkey_quota,
            "relays_over_global_cap": status.targets.relays_over_global_cap,
            "relays_over_host_cap": status.targets.relays_over_host_cap,
            "relays_other_shards": status.targets.relays_other_shards,
            "relays_failing": status.relays_failing,
            "hosts_with_several_urls": status
                .hosts_with_several_urls
                .iter()
                .map(|(host, n)| json!({"host": host, "urls": n}))
                .collect::<Vec<_>>(),
        },
        "state_file": {
            "enabled": status.state_file.enabled,
            "loaded": status.state_file.loaded,
            "ignored": status.state_file.ignored.as_ref().map(|(r, d)| json!({"reason": r, "detail": d})),
            "relays_restored": status.state_file.relays_restored,
            "saves": status.state_file.saves,
            "save_failures": status.state_file.save_failures,
            "last_save_ms": status.state_file.last_save_ms,
            "last_error": status.state_file.last_error,
        },
        "sync": {
            "batches_confirmed": c.batches_confirmed,
            "batches_failed": c.batches_failed,
            "pages_requested": c.pages_requested,
            "incomplete_queries": c.incomplete_queries,
            "queries_resent": c.queries_resent,
            "queries_resumed": c.queries_resumed,
            "rate_limited": c.rate_limited,
            "relays_refused": c.relays_refused,
            "relays_excluded": c.relays_excluded,
            "hosts_excluded": c.hosts_excluded,
            "pubkeys_blocked": c.pubkeys_blocked,
            "selections": c.selections,
            "announcement_relays_dropped": c.announcement_relays_dropped,
            "closed_by_relay": c.closed_by_relay,
            "consolidations": c.consolidations,
            "daily_resyncs": c.daily_resyncs,
            "self_events": c.self_events,
            "self_batches": c.self_batches,
            "reconciliations": c.reconciliations,
            "reconcile_ids_fetched": c.reconcile_ids_fetched,
            "reconcile_fallbacks": crate::core::sync::FallbackReason::ALL
                .iter()
                .map(|r| (r.label().to_string(), json!(c.fallbacks(*r))))
                .collect::<serde_json::Map<String, Value>>(),
            "neg_unknown": c.neg_unknown,
            "nip77_detections": c.nip77_detections,
            "reconcile_skipped_empty": c.reconcile_skipped_empty,
            "own_reads_skipped": c.own_reads_skipped,
            "fetch_ids_retried": c.fetch_ids_retried,
            "fetch_ids_undelivered": c.fetch_ids_undelivered,
            "cap_probes": c.cap_probes,
            "caps_learned": c.caps_learned,
            "replies_not_followed": {
                "depth": c.replies_beyond_depth,
                "thread": c.replies_thread_full,
                "cap": c.replies_cap_reached,
                "waiting": c.replies_waiting_dropped,
            },
            "own_thread_rereads": c.own_thread_rereads,
            "forwarder_losses": c.forwarder_losses,
        },
        "relays": relays,
    })
}

fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The per-relay table of a `/status` document, for a terminal.
pub fn table(doc: &Value) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "own relay: {}   settled: {}   repositories: {}   root events: {}   replies followed: {}   forwarded: {}   backlog: {}",
        s(&doc["own_relay"]),
        s(&doc["settled"]),
        s(&doc["repositories"]),
        s(&doc["root_events"]),
        s(&doc["thread_events"]),
        s(&doc["forward"]["stored"]),
        s(&doc["forward"]["backlog"]),
    );
    let p = &doc["progress"];
    let _ = writeln!(
        out,
        "progress: repos {}/{}   root events {}/{}   history queries pending: {}   forwarded/s: {}   time to settle: {}",
        s(&p["repositories"]["confirmed"]),
        s(&p["repositories"]["target"]),
        s(&p["root_events"]["confirmed"]),
        s(&p["root_events"]["target"]),
        s(&p["history_queries_pending"]),
        s(&p["events_forwarded_per_second"]),
        s(&p["eta"]),
    );
    let header = [
        "RELAY",
        "STATE",
        "HEALTH",
        "SUBS",
        "REPOS",
        "ROOTS",
        "PENDING",
        "FAILED",
        "INCOMPL",
        "EVENTS",
        "QUERIES",
        "EVENTS/S",
        "SETTLE IN",
        "LAST ERROR",
    ];
    let mut rows: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for r in doc["relays"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        rows.push(vec![
            s(&r["url"]),
            s(&r["connection"]),
            s(&r["health"]),
            s(&r["open_subscriptions"]),
            format!(
                "{}/{}",
                s(&r["confirmed"]["repositories"]),
                s(&r["target"]["repositories"])
            ),
            format!(
                "{}/{}",
                s(&r["confirmed"]["root_events"]),
                s(&r["target"]["root_events"])
            ),
            s(&r["pending"]["batches"]),
            s(&r["failed_batches"]),
            s(&r["incomplete_queries"]),
            s(&r["events"]["accepted"]),
            s(&r["progress"]["history_queries_pending"]),
            s(&r["progress"]["events_forwarded_per_second"]),
            s(&r["progress"]["eta"]),
            s(&r["last_error"]),
        ]);
    }
    let widths: Vec<usize> = (0..header.len())
        .map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0))
        .collect();
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    out
}

fn html_escape(v: &str) -> String {
    v.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// A small server-rendered status page: no JavaScript, no external assets.
pub fn html(status: &Status) -> String {
    let doc = status_json(status);
    let mut out = String::new();
    let _ = write!(
        out,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>grasp-sync status</title>\
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse}}\
td,th{{border:1px solid #ccc;padding:.25em .5em;text-align:left}}th{{background:#eee}}\
.bad{{color:#a00}}</style></head><body><h1>grasp-sync {}</h1>",
        html_escape(env!("CARGO_PKG_VERSION"))
    );
    let _ = write!(
        out,
        "<p>Own relay: <b>{}</b> · settled: <b>{}</b> · repositories: {} · root events: {} · \
forwarded: {} · duplicates: {} · rejected: {} · backlog: {}</p>",
        html_escape(&s(&doc["own_relay"])),
        s(&doc["settled"]),
        status.repos,
        status.root_events,
        status.forwarded,
        status.duplicates,
        status.rejected,
        status.forward_backlog
    );
    let p = &status.progress;
    let _ = write!(
        out,
        "<p id=\"progress\">Progress: repositories confirmed {}/{} · root events confirmed {}/{} \
(summed over relays) · history queries pending: {} · forwarded per second: {} · relays settled: \
{}/{} · <b>time to settle: {}</b></p>",
        p.confirmed_repos,
        p.target_repos,
        p.confirmed_root_events,
        p.target_root_events,
        p.history_queries_pending,
        s(&rate(p.events_forwarded_per_second)),
        p.relays_settled,
        status.relays.len(),
        html_escape(&p.eta.to_string()),
    );
    out.push_str(
        "<table><tr><th>Relay</th><th>State</th><th>Health</th><th>Subscriptions</th>\
<th>Repositories</th><th>Root events</th><th>Pending batches</th><th>Failed batches</th>\
<th>Incomplete</th><th>Events</th><th>Pending queries</th><th>Events/s</th>\
<th>Time to settle</th><th>Last error</th></tr>",
    );
    for r in &status.relays {
        let bad = r.connection_status != ConnectionStatus::Connected;
        let _ = write!(
            out,
            "<tr{}><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}/{}</td><td>{}/{}</td>\
<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            if bad { " class=\"bad\"" } else { "" },
            html_escape(r.url.as_str()),
            connection_word(r.connection_status),
            health_word(r.health),
            r.open_subscriptions,
            r.confirmed_repos,
            r.target_repos,
            r.confirmed_root_events,
            r.target_root_events,
            r.pending_batches,
            r.failed_batches,
            r.incomplete_queries,
            r.events_accepted,
            r.progress.history_queries_pending,
            s(&rate(r.progress.events_forwarded_per_second)),
            html_escape(&r.progress.eta.to_string()),
            html_escape(r.last_error.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table><p><a href=\"/metrics\">/metrics</a> · <a href=\"/status\">/status</a> · <a href=\"/healthz\">/healthz</a></p></body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use crate::core::sync::FallbackReason;

    #[test]
    fn fallback_labels_are_stable() {
        // Label values of `reconcile_fallbacks_total{reason=…}` and keys of `/status`:
        // dashboards depend on them.
        assert_eq!(
            FallbackReason::ALL.map(FallbackReason::label),
            [
                "neg_err",
                "closed",
                "unsupported",
                "timeout",
                "malformed",
                "too_many_ids",
                "too_many_rounds",
                "own_side"
            ]
        );
        assert_eq!(
            FallbackReason::NegErr.to_string(),
            "the relay answered NEG-ERR"
        );
    }
}
