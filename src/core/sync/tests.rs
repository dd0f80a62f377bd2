//! Deterministic tests of [`SyncMachine`] in simulated time: inputs in, commands out.

use std::collections::HashSet;
use std::time::Duration;

use nostr::event::{Event, EventBuilder, EventId, FinalizeEvent, Kind, Tag};
use nostr::filter::Filter;
use nostr::message::SubscriptionId;

use crate::core::paging::PageStats;
use crate::core::state::ConnectionStatus;
use crate::core::sync::world::{announcement, keys, repo};
use crate::core::sync::{Command, Report, SubPurpose, SyncConfig, SyncMachine};
use crate::core::time::Time;
use crate::shared::url::RelayUrl;

const OWN: &str = "ws://own.example";

fn url(s: &str) -> RelayUrl {
    RelayUrl::parse(s).unwrap()
}

fn issue(d: &str, text: &str) -> Event {
    EventBuilder::new(Kind::Custom(1621), text)
        .tag(Tag::parse(["a", &repo(d)]).unwrap())
        .finalize(&keys())
        .unwrap()
}

struct Sim {
    m: SyncMachine,
    now: Time,
    own_gen: u64,
}

impl Sim {
    fn new(cfg: impl FnOnce(&mut SyncConfig)) -> Sim {
        let mut c = SyncConfig::new(url(OWN));
        c.batch_window = Duration::from_secs(5);
        // The design's scenarios assume a relay that allows more than 70 subscriptions;
        // the budget tests set their own.
        c.default_subscription_budget = 1000;
        cfg(&mut c);
        let mut s = Sim {
            m: SyncMachine::new(c),
            now: Time::from_secs(1_700_000_000),
            own_gen: 0,
        };
        s.m.start(s.now);
        let cmds = s.drain();
        s.own_gen = match &cmds[0] {
            Command::Connect { relay, generation } if relay.as_str() == OWN => *generation,
            other => panic!("first command must connect the own relay, got {other:?}"),
        };
        s
    }

    fn drain(&mut self) -> Vec<Command> {
        std::iter::from_fn(|| self.m.poll_command()).collect()
    }

    fn advance(&mut self, d: Duration) -> Vec<Command> {
        let end = self.now.plus(d);
        // Fire every timer on the way, as the coordinator would.
        while let Some(t) = self.m.poll_timeout() {
            if t > end {
                break;
            }
            self.now = t.max(self.now);
            self.m.handle_timeout(self.now);
        }
        self.now = end;
        self.m.handle_timeout(self.now);
        self.drain()
    }

    fn report(&mut self, r: Report) -> Vec<Command> {
        self.m.handle_report(r, self.now);
        self.drain()
    }

    /// The own relay connects; its (empty) stored history is delivered at once.
    fn own_connected(&mut self) -> Vec<Command> {
        let g = self.own_gen;
        let cmds = self.report(Report::Connected {
            relay: url(OWN),
            generation: g,
        });
        for (sub_id, _) in subscribes(&cmds, OWN) {
            self.eose(OWN, sub_id, PageStats::default());
        }
        cmds
    }

    fn self_event(&mut self, e: &Event) -> Vec<Command> {
        let g = self.own_gen;
        self.report(Report::SelfEvent {
            generation: g,
            event: Box::new(e.clone()),
        })
    }

    fn gen(&self, relay: &str) -> u64 {
        self.m.relay_index()[&url(relay)].generation
    }

    fn connected(&mut self, relay: &str) -> Vec<Command> {
        let g = self.gen(relay);
        self.report(Report::Connected {
            relay: url(relay),
            generation: g,
        })
    }

    fn disconnected(&mut self, relay: &str) -> Vec<Command> {
        let g = self.gen(relay);
        self.report(Report::Disconnected {
            relay: url(relay),
            generation: g,
            cause: crate::core::session::Disconnect::Read("test".into()),
        })
    }

    /// EOSE for `sub_id` on `relay`'s current connection (the own relay included).
    fn eose(&mut self, relay: &str, sub_id: SubscriptionId, stats: PageStats) -> Vec<Command> {
        let generation = if relay == OWN {
            self.own_gen
        } else {
            self.gen(relay)
        };
        self.report(Report::Eose {
            relay: url(relay),
            generation,
            sub_id,
            stats,
        })
    }

    fn eose_all(&mut self, relay: &str, cmds: &[Command]) -> Vec<Command> {
        let mut out = vec![];
        for (sub_id, _) in subscribes(cmds, relay) {
            out.extend(self.eose(relay, sub_id, PageStats::default()));
        }
        out
    }
}

/// EOSE for the Layer-1 subscription among `cmds` (its history is delivered).
fn eose_l1(s: &mut Sim, relay: &str, cmds: &[Command]) {
    for (sub_id, f) in subscribes(cmds, relay) {
        if is_l1(&f) {
            s.eose(relay, sub_id, PageStats::default());
        }
    }
}

fn subscribes(cmds: &[Command], relay: &str) -> Vec<(SubscriptionId, Filter)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Subscribe {
                relay: r,
                sub_id,
                filter,
                ..
            } if r.as_str() == relay => Some((sub_id.clone(), filter.clone())),
            _ => None,
        })
        .collect()
}

fn json(f: &Filter) -> serde_json::Value {
    serde_json::from_str(&f.as_json()).unwrap()
}

fn is_l1(f: &Filter) -> bool {
    json(f)["kinds"] == serde_json::json!([30617, 30618])
}

fn since(f: &Filter) -> Option<u64> {
    json(f)["since"].as_u64()
}

/// A live-only subscription: `limit: 0`, no `since`/`until` (relays apply `since` to live
/// events too).
fn is_live_only(f: &Filter) -> bool {
    let j = json(f);
    j["limit"].as_u64() == Some(0) && j.get("since").is_none() && j.get("until").is_none()
}

fn connects(cmds: &[Command]) -> Vec<String> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Connect { relay, .. } => Some(relay.to_string()),
            _ => None,
        })
        .collect()
}

/// Own relay connected, one announcement for `relays`, batch fired.
fn discovered(relays: &[&str]) -> (Sim, Vec<Command>) {
    let mut s = Sim::new(|_| {});
    let cmds = s.own_connected();
    let self_sub = subscribes(&cmds, OWN);
    assert_eq!(self_sub.len(), 1);
    assert_eq!(
        since(&self_sub[0].1),
        None,
        "first self-subscription has no since"
    );
    s.self_event(&announcement("r", relays, 1000));
    let cmds = s.advance(Duration::from_secs(5));
    (s, cmds)
}

#[test]
fn batch_window_starts_at_first_event_and_does_not_reset() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.self_event(&announcement("a", &["wss://a.example"], 1));
    assert!(s.advance(Duration::from_secs(3)).is_empty());
    s.self_event(&announcement("b", &["wss://b.example"], 1));
    // 5 s after the FIRST event, not the second.
    let cmds = s.advance(Duration::from_secs(2));
    let mut c = connects(&cmds);
    c.sort();
    assert_eq!(c, vec!["wss://a.example", "wss://b.example"]);
    assert_eq!(s.m.repo_index().len(), 2);
}

#[test]
fn fresh_sync_subscribes_l1_without_since_then_layers_2_3_as_a_batch() {
    let (mut s, cmds) = discovered(&["wss://a.example"]);
    assert_eq!(connects(&cmds), vec!["wss://a.example"]);
    assert_eq!(
        s.m.relay_index()[&url("wss://a.example")].connection_status,
        ConnectionStatus::Connecting
    );
    let cmds = s.connected("wss://a.example");
    let subs = subscribes(&cmds, "wss://a.example");
    assert_eq!(subs.len(), 4, "L1 + a/A/q");
    assert!(is_l1(&subs[0].1) && since(&subs[0].1).is_none());
    assert!(subs[1..].iter().all(|(_, f)| since(f).is_none()));
    assert_eq!(s.m.pending_index()[&url("wss://a.example")].len(), 1);
    // Not confirmed until every batch subscription saw EOSE.
    for (i, (sub_id, _)) in subs[1..].iter().enumerate() {
        assert!(
            s.m.relay_index()[&url("wss://a.example")].repos.is_empty(),
            "after {i} EOSEs"
        );
        s.eose("wss://a.example", sub_id.clone(), PageStats::default());
    }
    let st = &s.m.relay_index()[&url("wss://a.example")];
    assert_eq!(st.repos, [repo("r")].into());
    assert!(!s.m.pending_index().contains_key(&url("wss://a.example")));
    assert_eq!(s.m.counters().batches_confirmed, 1);
}

#[test]
fn root_events_add_layer3_batches_only_for_new_items() {
    let (mut s, _) = discovered(&["wss://a.example"]);
    let cmds = s.connected("wss://a.example");
    s.eose_all("wss://a.example", &cmds);
    let iss = issue("r", "bug");
    s.self_event(&iss);
    let cmds = s.advance(Duration::from_secs(5));
    let subs = subscribes(&cmds, "wss://a.example");
    assert_eq!(
        subs.len(),
        3,
        "e/E/q for the one new root event, nothing for the confirmed repo"
    );
    for (_, f) in &subs {
        let j = json(f);
        let key = j
            .as_object()
            .unwrap()
            .keys()
            .find(|k| k.starts_with('#'))
            .unwrap()
            .clone();
        assert!(["#e", "#E", "#q"].contains(&key.as_str()));
        assert_eq!(j[&key], serde_json::json!([iss.id.to_hex()]));
    }
    // Same event again: nothing new.
    s.self_event(&iss);
    assert!(subscribes(&s.advance(Duration::from_secs(5)), "wss://a.example").is_empty());
}

#[test]
fn newer_announcement_replaces_relay_set_older_is_ignored() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.self_event(&announcement("r", &["wss://a.example"], 100));
    s.advance(Duration::from_secs(5));
    s.self_event(&announcement("r", &["wss://b.example"], 200));
    s.advance(Duration::from_secs(5));
    let relays = &s.m.repo_index()[&repo("r")].relays;
    assert_eq!(relays, &HashSet::from([url("wss://b.example")]));
    s.self_event(&announcement("r", &["wss://c.example"], 150));
    s.advance(Duration::from_secs(5));
    assert_eq!(
        s.m.repo_index()[&repo("r")].relays,
        HashSet::from([url("wss://b.example")])
    );
}

#[test]
fn own_relay_and_aliases_are_never_targets() {
    let mut s = Sim::new(|c| c.own_aliases = vec![url("wss://git.example.com")]);
    s.own_connected();
    s.self_event(&announcement(
        "r",
        &[
            "ws://OWN.example/",
            "wss://git.example.com:443",
            "wss://a.example",
        ],
        1,
    ));
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(connects(&cmds), vec!["wss://a.example"]);
}

#[test]
fn failed_first_connect_is_retried_with_backoff() {
    let (mut s, _) = discovered(&["wss://a.example"]);
    s.disconnected("wss://a.example");
    assert_eq!(
        s.m.relay_index()[&url("wss://a.example")].connection_status,
        ConnectionStatus::Disconnected
    );
    // Backoff 5 s ± 25 %: nothing at 3 s, a retry by 7 s.
    assert!(connects(&s.advance(Duration::from_secs(3))).is_empty());
    assert_eq!(
        connects(&s.advance(Duration::from_secs(4))),
        vec!["wss://a.example"]
    );
    // Unreachable for two simulated hours, then reachable: it still gets synced.
    for _ in 0..200 {
        if s.m.relay_index()[&url("wss://a.example")].connection_status
            == ConnectionStatus::Connecting
        {
            s.disconnected("wss://a.example");
        }
        s.advance(Duration::from_secs(60));
        if s.now.as_secs() >= 1_700_000_000 + 7200 {
            break;
        }
    }
    let cmds = s.advance(Duration::from_secs(3600));
    assert_eq!(connects(&cmds).len(), 1, "retried within the 1 h cap");
    let cmds = s.connected("wss://a.example");
    assert_eq!(subscribes(&cmds, "wss://a.example").len(), 4);
}

#[test]
fn stale_reports_of_an_earlier_connection_are_ignored() {
    let (mut s, _) = discovered(&["wss://a.example"]);
    let old = s.gen("wss://a.example");
    s.connected("wss://a.example");
    s.disconnected("wss://a.example");
    s.advance(Duration::from_secs(10)); // reconnect attempt → new generation
    assert!(s.gen("wss://a.example") > old);
    let cmds = s.report(Report::Connected {
        relay: url("wss://a.example"),
        generation: old,
    });
    assert!(cmds.is_empty());
    assert_eq!(
        s.m.relay_index()[&url("wss://a.example")].connection_status,
        ConnectionStatus::Connecting
    );
}

fn synced(relay: &str) -> Sim {
    let (mut s, _) = discovered(&[relay]);
    s.self_event(&issue("r", "one"));
    s.advance(Duration::from_secs(5));
    let cmds = s.connected(relay);
    s.eose_all(relay, &cmds);
    let st = &s.m.relay_index()[&url(relay)];
    assert_eq!((st.repos.len(), st.root_events.len()), (1, 1));
    s
}

#[test]
fn quick_reconnect_catches_up_layers_1_2_3_with_since_from_last_connect() {
    let relay = "wss://a.example";
    let mut s = synced(relay);
    let connected_at = s.m.relay_index()[&url(relay)].last_connected.unwrap();
    s.advance(Duration::from_secs(600));
    s.disconnected(relay);
    let cmds = s.advance(Duration::from_secs(14 * 60));
    assert_eq!(connects(&cmds), vec![relay]);
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    // L1 + L2 (3) + L3 (3) live without since, and the same seven as history catch-ups
    // with since = last_connected − 15 min; none pending.
    assert_eq!(subs.len(), 14);
    let want = connected_at.minus(Duration::from_secs(900)).as_secs();
    let (live, history): (Vec<_>, Vec<_>) = subs.iter().partition(|(_, f)| is_live_only(f));
    assert_eq!((live.len(), history.len()), (7, 7));
    assert!(
        history.iter().all(|(_, f)| since(f) == Some(want)),
        "since {want}"
    );
    assert!(is_l1(&live[0].1) && is_l1(&history[0].1));
    assert!(!s.m.pending_index().contains_key(&url(relay)));
    assert_eq!(
        s.m.relay_index()[&url(relay)].repos.len(),
        1,
        "confirmed kept"
    );
    let purposes: Vec<SubPurpose> =
        s.m.subscriptions(&url(relay))
            .into_iter()
            .map(|x| x.1)
            .collect();
    let count = |want: SubPurpose| purposes.iter().filter(|p| **p == want).count();
    assert_eq!(
        (count(SubPurpose::Live), count(SubPurpose::CatchUp)),
        (6, 7)
    );
    // The catch-ups close at their EOSE; the live set stays.
    s.eose_all(relay, &cmds);
    assert_eq!(s.m.subscriptions(&url(relay)).len(), 7);
}

#[test]
fn stale_reconnect_after_16_minutes_is_a_fresh_sync() {
    let relay = "wss://a.example";
    let mut s = synced(relay);
    s.disconnected(relay);
    // Fail repeatedly so the reconnect comes after 16 minutes.
    let mut t = 0;
    while t < 16 * 60 {
        let cmds = s.advance(Duration::from_secs(30));
        t += 30;
        if !connects(&cmds).is_empty() && t < 16 * 60 {
            s.disconnected(relay);
        }
    }
    let cmds = s.advance(Duration::from_secs(3600));
    assert_eq!(connects(&cmds).len(), 1);
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    assert!(
        subs.iter().all(|(_, f)| since(f).is_none()),
        "fresh: no since"
    );
    assert_eq!(subs.len(), 7, "L1 + a pending batch of 6");
    assert!(
        s.m.relay_index()[&url(relay)].repos.is_empty(),
        "confirmed cleared"
    );
    assert_eq!(s.m.pending_index()[&url(relay)].len(), 1);
}

#[test]
fn disconnect_clears_pending_and_items_are_resubscribed() {
    let (mut s, _) = discovered(&["wss://a.example"]);
    s.connected("wss://a.example");
    assert_eq!(s.m.pending_index()[&url("wss://a.example")].len(), 1);
    s.disconnected("wss://a.example");
    assert!(!s.m.pending_index().contains_key(&url("wss://a.example")));
    s.advance(Duration::from_secs(10));
    let cmds = s.connected("wss://a.example");
    // Never confirmed → quick reconnect: the interrupted Layer 1 history again (no since),
    // Layer 1 live and its catch-up, and the batch again.
    let subs = subscribes(&cmds, "wss://a.example");
    assert_eq!(subs.len(), 6);
    assert!(is_l1(&subs[0].1) && since(&subs[0].1).is_none() && !is_live_only(&subs[0].1));
    assert_eq!(s.m.pending_index()[&url("wss://a.example")].len(), 1);
}

#[test]
fn withheld_eose_fails_the_batch_and_it_is_retried() {
    let mut s = Sim::new(|c| c.eose_timeout = Duration::from_secs(60));
    s.own_connected();
    s.self_event(&announcement("r", &["wss://a.example"], 1));
    s.advance(Duration::from_secs(5));
    let cmds = s.connected("wss://a.example");
    eose_l1(&mut s, "wss://a.example", &cmds);
    // One subscription answered, two did not.
    let sub = subscribes(&cmds, "wss://a.example")[1].0.clone();
    s.eose("wss://a.example", sub, PageStats::default());
    let cmds = s.advance(Duration::from_secs(61));
    let closes = cmds
        .iter()
        .filter(|c| matches!(c, Command::Unsubscribe { .. }))
        .count();
    assert_eq!(closes, 3, "all the failed batch's subscriptions are closed");
    assert_eq!(
        s.m.subscriptions(&url("wss://a.example")).len(),
        1,
        "only L1 left"
    );
    assert!(!s.m.pending_index().contains_key(&url("wss://a.example")));
    assert_eq!(s.m.counters().batches_failed, 1);
    let cmds = s.advance(Duration::from_secs(30));
    assert_eq!(
        subscribes(&cmds, "wss://a.example").len(),
        3,
        "retried after backoff"
    );
}

#[test]
fn closed_subscription_fails_its_batch_instead_of_leaving_it_pending() {
    let (mut s, _) = discovered(&["wss://a.example"]);
    let cmds = s.connected("wss://a.example");
    eose_l1(&mut s, "wss://a.example", &cmds);
    let subs = subscribes(&cmds, "wss://a.example");
    let g = s.gen("wss://a.example");
    s.report(Report::Closed {
        relay: url("wss://a.example"),
        generation: g,
        sub_id: subs[1].0.clone(),
        message: "error: shutting down".into(),
    });
    assert!(!s.m.pending_index().contains_key(&url("wss://a.example")));
    // A refused query is tried again after `refused_retry` (10 min).
    let cmds = s.advance(Duration::from_secs(610));
    assert_eq!(subscribes(&cmds, "wss://a.example").len(), 3);
}

#[test]
fn idle_relay_is_forgotten_but_bootstrap_and_first_sync_relays_are_not() {
    let mut s = Sim::new(|c| c.bootstrap = vec![url("wss://boot.example")]);
    s.drain();
    s.own_connected();
    let g = s.gen("wss://boot.example");
    s.report(Report::Connected {
        relay: url("wss://boot.example"),
        generation: g,
    });
    s.self_event(&announcement("r", &["wss://a.example"], 1));
    s.advance(Duration::from_secs(5));
    s.connected("wss://a.example");
    // First sync in progress (no EOSE) across several checks: kept.
    let cmds = s.advance(Duration::from_secs(200));
    assert!(!cmds.iter().any(|c| matches!(c, Command::Forget { .. })));
    assert!(s.m.relay_index().contains_key(&url("wss://a.example")));
    // The announcement moves the repo elsewhere: a.example is no longer needed.
    s.self_event(&announcement("r", &["wss://b.example"], 2));
    // Its unanswered batch keeps it until the batch fails at the EOSE deadline (120 s).
    let cmds = s.advance(Duration::from_secs(60));
    assert!(!cmds.iter().any(|c| matches!(c, Command::Forget { .. })));
    let cmds = s.advance(Duration::from_secs(130));
    assert!(cmds.contains(&Command::Forget {
        relay: url("wss://a.example")
    }));
    assert!(!s.m.relay_index().contains_key(&url("wss://a.example")));
    assert!(s.m.relay_index().contains_key(&url("wss://boot.example")));
}

#[test]
fn self_subscription_reconnect_reads_the_whole_history_again() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    let first = s.now;
    s.advance(Duration::from_secs(3600));
    let g = s.own_gen;
    s.report(Report::Disconnected {
        relay: url(OWN),
        generation: g,
        cause: crate::core::session::Disconnect::Read("test".into()),
    });
    let cmds = s.advance(Duration::from_secs(10));
    s.own_gen = match cmds.as_slice() {
        [Command::Connect { generation, .. }] => *generation,
        other => panic!("{other:?}"),
    };
    let cmds = s.own_connected();
    let subs = subscribes(&cmds, OWN);
    // A since would miss old events stored meanwhile (what the forwarder copied in).
    assert_eq!(subs.len(), 1);
    assert_eq!(since(&subs[0].1), None);
    assert!(s.now.as_secs() > first.as_secs());
}

#[test]
fn events_from_an_old_self_subscription_generation_are_ignored() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.report(Report::SelfEvent {
        generation: 999,
        event: Box::new(announcement("r", &["wss://a.example"], 1)),
    });
    assert!(s.advance(Duration::from_secs(10)).is_empty());
    assert!(s.m.repo_index().is_empty());
    let _: EventId = issue("r", "x").id;
}

fn unsubscribes(cmds: &[Command]) -> usize {
    cmds.iter()
        .filter(|c| matches!(c, Command::Unsubscribe { .. }))
        .count()
}

fn tag_values(f: &Filter, key: &str) -> Vec<String> {
    json(f)[key]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

/// A relay carrying one repo and `n` root events, each added in its own batch.
fn many_batches(n: usize) -> (Sim, Vec<EventId>) {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    s.eose_all(relay, &cmds);
    let mut ids = vec![];
    for i in 0..n {
        let e = issue("r", &format!("issue {i}"));
        ids.push(e.id);
        s.self_event(&e);
        let cmds = s.advance(Duration::from_secs(5));
        assert_eq!(unsubscribes(&cmds), 0, "no consolidation yet at batch {i}");
        s.eose_all(relay, &cmds);
    }
    (s, ids)
}

#[test]
fn crossing_the_consolidation_threshold_leaves_fewer_subscriptions_and_loses_nothing() {
    let relay = "wss://a.example";
    let (mut s, ids) = many_batches(22);
    assert_eq!(s.m.subscriptions(&url(relay)).len(), 1 + 3 + 22 * 3);
    let e = issue("r", "the 23rd");
    s.self_event(&e);
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(unsubscribes(&cmds), 70, "every settled subscription closed");
    let subs = subscribes(&cmds, relay);
    // L1 + L2 (3) + L3 for 22 roots (3) live, the same seven as catch-ups with since, and
    // the new root's batch (3).
    assert_eq!(subs.len(), 17);
    assert_eq!(s.m.subscriptions(&url(relay)).len(), 17);
    let want_since = s.now.minus(Duration::from_secs(900)).as_secs();
    let live: Vec<&Filter> = subs[..7].iter().map(|(_, f)| f).collect();
    let catchup: Vec<&Filter> = subs[7..14].iter().map(|(_, f)| f).collect();
    assert!(live.iter().all(|f| is_live_only(f)));
    assert!(catchup.iter().all(|f| since(f) == Some(want_since)));
    assert!(is_l1(live[0]) && is_l1(catchup[0]));
    let mut covered: HashSet<String> = HashSet::new();
    for f in &live {
        covered.extend(tag_values(f, "#e"));
    }
    let confirmed: HashSet<String> = ids.iter().map(|i| i.to_hex()).collect();
    assert_eq!(
        covered, confirmed,
        "every confirmed root event is still subscribed"
    );
    let new_batch: Vec<&Filter> = subs[14..].iter().map(|(_, f)| f).collect();
    assert!(
        new_batch
            .iter()
            .all(|f| since(f).is_none() && !is_live_only(f)),
        "new items get full history"
    );
    assert_eq!(tag_values(new_batch[0], "#e"), vec![e.id.to_hex()]);
    s.eose_all(relay, &cmds);
    assert_eq!(s.m.relay_index()[&url(relay)].root_events.len(), 23);
    assert!(s.m.relay_index()[&url(relay)].repos.contains(&repo("r")));
}

#[test]
fn consolidation_waits_for_pending_batches_without_blocking() {
    let relay = "wss://a.example";
    let (mut s, _) = many_batches(21);
    // 67 open; batch 22 (70 open, not above the threshold) stays pending (no EOSE) ...
    s.self_event(&issue("r", "pending one"));
    let pending_cmds = s.advance(Duration::from_secs(5));
    assert_eq!(unsubscribes(&pending_cmds), 0);
    // ... when batch 23 crosses the threshold: deferred, nothing closed yet.
    s.self_event(&issue("r", "deferred one"));
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(unsubscribes(&cmds), 0);
    assert!(subscribes(&cmds, relay).is_empty());
    // The pending batch completes: consolidation runs at once.
    let cmds = s.eose_all(relay, &pending_cmds);
    assert_eq!(unsubscribes(&cmds), 70);
    assert_eq!(subscribes(&cmds, relay).len(), 2 * (1 + 3 + 3) + 3);
    assert_eq!(s.m.subscriptions(&url(relay)).len(), 17);
}

#[test]
fn consolidation_deadline_keeps_loading_subscriptions_open() {
    let relay = "wss://a.example";
    let (mut s, _) = many_batches(21);
    s.self_event(&issue("r", "never answered"));
    let pending_cmds = s.advance(Duration::from_secs(5));
    // One of the pending batch's three subscriptions has seen EOSE: it must stay open too,
    // or the batch's items would have no live subscription once it confirms.
    let first = subscribes(&pending_cmds, relay)[0].0.clone();
    s.eose(relay, first, PageStats::default());
    s.self_event(&issue("r", "deferred"));
    s.advance(Duration::from_secs(5));
    // 30 s later the consolidation runs anyway; the unanswered batch stays open.
    let cmds = s.advance(Duration::from_secs(30));
    assert_eq!(unsubscribes(&cmds), 67);
    let open: HashSet<SubscriptionId> =
        s.m.subscriptions(&url(relay))
            .into_iter()
            .map(|x| x.0)
            .collect();
    for (sub, _) in subscribes(&pending_cmds, relay) {
        assert!(open.contains(&sub), "loading subscription {sub} kept");
    }
    assert_eq!(s.m.pending_index()[&url(relay)].len(), 2);
}

#[test]
fn daily_timer_does_a_full_fresh_sync_between_23_and_25_hours() {
    let relay = "wss://a.example";
    let mut s = synced(relay);
    let start = s.now;
    let mut fired_at = None;
    let mut fired = vec![];
    for _ in 0..(26 * 60) {
        let cmds = s.advance(Duration::from_secs(60));
        if unsubscribes(&cmds) > 0 {
            fired_at = Some(s.now);
            fired = cmds;
            break;
        }
    }
    let at = fired_at.expect("daily resync fired");
    let h = at.since(start).as_secs_f64() / 3600.0;
    assert!((23.0..=25.1).contains(&h), "fired after {h} h");
    assert_eq!(unsubscribes(&fired), 7, "L1 + L2 + L3 closed");
    let subs = subscribes(&fired, relay);
    assert_eq!(subs.len(), 7);
    assert!(
        subs.iter().all(|(_, f)| since(f).is_none()),
        "full history again"
    );
    assert!(
        s.m.relay_index()[&url(relay)].repos.is_empty(),
        "confirmed cleared"
    );
    assert_eq!(s.m.pending_index()[&url(relay)].len(), 1);
    s.eose_all(relay, &fired);
    assert_eq!(s.m.relay_index()[&url(relay)].repos.len(), 1);
}

/// Delays between consecutive connect attempts of a relay that always fails.
fn attempt_gaps(s: &mut Sim, relay: &str, attempts: usize, step: Duration) -> Vec<Duration> {
    let mut last = s.now;
    let mut gaps = vec![];
    while gaps.len() < attempts {
        let cmds = s.advance(step);
        if !connects(&cmds).is_empty() {
            gaps.push(s.now.since(last));
            last = s.now;
            s.disconnected(relay);
        }
    }
    gaps
}

#[test]
fn flapping_relay_backoff_grows() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    // Every attempt connects and drops at once: the failure count is never reset.
    let mut gaps = vec![];
    let mut last = s.now;
    for _ in 0..6 {
        s.connected(relay);
        s.advance(Duration::from_secs(1));
        s.disconnected(relay);
        loop {
            let cmds = s.advance(Duration::from_secs(1));
            if !connects(&cmds).is_empty() {
                break;
            }
        }
        gaps.push(s.now.since(last).as_secs());
        last = s.now;
    }
    // 5 s × 2^(n−1) ± 25 % (+1 s connected each time).
    for (i, g) in gaps.iter().enumerate() {
        let base = 5u64 << i;
        assert!(
            *g as f64 >= base as f64 * 0.75 && *g as f64 <= base as f64 * 1.25 + 3.0,
            "gap {i} = {g} s, base {base} s ({gaps:?})"
        );
    }
    assert!(gaps.windows(2).all(|w| w[1] > w[0]), "{gaps:?}");
}

#[test]
fn dead_after_24_hours_then_one_attempt_a_day() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let start = s.now;
    s.disconnected(relay);
    let gaps = attempt_gaps(&mut s, relay, 40, Duration::from_secs(60));
    let mut at = Duration::ZERO;
    let mut daily = 0;
    for g in &gaps {
        if at < Duration::from_secs(24 * 3600) {
            // Degraded: exponential backoff capped at 1 h (+25 % jitter, 60 s steps).
            assert!(
                *g <= Duration::from_secs(4500 + 60),
                "gap {g:?} at {at:?}: {gaps:?}"
            );
        } else {
            // Dead: once a day (+10 % jitter).
            assert!(*g >= Duration::from_secs(24 * 3600), "gap {g:?} at {at:?}");
            assert!(
                *g <= Duration::from_secs(26 * 3600 + 60),
                "gap {g:?} at {at:?}"
            );
            daily += 1;
        }
        at += *g;
    }
    assert!(daily >= 3, "{gaps:?}");
    assert_eq!(
        s.m.relay_statuses(s.now)[0].health,
        crate::core::health::HealthState::Dead
    );
    assert!(s.now.since(start) > Duration::from_secs(4 * 24 * 3600));
    // It comes back: a fresh sync, and healthy again once stable.
    let cmds = s.advance(Duration::from_secs(27 * 3600));
    assert_eq!(connects(&cmds).len(), 1);
    let cmds = s.connected(relay);
    assert_eq!(subscribes(&cmds, relay).len(), 4);
    s.advance(Duration::from_secs(120));
    assert_eq!(
        s.m.relay_statuses(s.now)[0].health,
        crate::core::health::HealthState::Healthy
    );
}

#[test]
fn capped_self_subscription_pages_with_until() {
    let mut s = Sim::new(|c| c.assumed_page_size = 20);
    let cmds = s.own_connected();
    let (sub, _) = subscribes(&cmds, OWN).remove(0);
    let g = s.own_gen;
    let stats = PageStats {
        received: 20,
        oldest: Some(1000),
        newest: Some(2000),
        ..PageStats::default()
    };
    let cmds = s.eose(OWN, sub.clone(), stats);
    let pages = subscribes(&cmds, OWN);
    assert_eq!(pages.len(), 1);
    assert_eq!(json(&pages[0].1)["until"], 1000);
    assert_eq!(
        json(&pages[0].1)["kinds"],
        json(&self_subscription_filter_for_test())["kinds"]
    );
    // A short page ends it and is closed; the live self-subscription stays.
    let cmds = s.eose(
        OWN,
        pages[0].0.clone(),
        PageStats {
            received: 3,
            oldest: Some(900),
            newest: Some(1000),
            ..PageStats::default()
        },
    );
    assert!(subscribes(&cmds, OWN).is_empty());
    assert!(cmds.contains(&Command::Unsubscribe {
        relay: url(OWN),
        generation: g,
        sub_id: pages[0].0.clone(),
    }));
    assert_eq!(s.m.counters().pages_requested, 1);
}

fn self_subscription_filter_for_test() -> Filter {
    crate::core::filters::self_subscription_filter(None)
}

#[test]
fn batch_waits_for_its_pages_before_confirming() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    let full = PageStats {
        received: 20,
        oldest: Some(500),
        newest: Some(900),
        ..PageStats::default()
    };
    // L1 and two of the three batch filters answer short; the #a filter is full.
    for (i, (sub, _)) in subs.iter().enumerate() {
        let stats = if i == 1 {
            full.clone()
        } else {
            PageStats::default()
        };
        let out = s.eose(relay, sub.clone(), stats);
        if i == 1 {
            let pages = subscribes(&out, relay);
            assert_eq!(pages.len(), 1);
            assert_eq!(json(&pages[0].1)["until"], 500);
            assert_eq!(tag_values(&pages[0].1, "#a"), vec![repo("r")]);
            // Pages finish before the batch may confirm.
            let last = subs.len() - 1;
            for (sub, _) in &subs[2..=last] {
                s.eose(relay, sub.clone(), PageStats::default());
            }
            assert!(
                s.m.relay_index()[&url(relay)].repos.is_empty(),
                "not before the page"
            );
            s.eose(relay, pages[0].0.clone(), PageStats::default());
            break;
        }
    }
    assert_eq!(s.m.relay_index()[&url(relay)].repos, [repo("r")].into());
    assert!(!s.m.pending_index().contains_key(&url(relay)));
}

fn closed(s: &mut Sim, relay: &str, sub: &SubscriptionId, message: &str) -> Vec<Command> {
    let g = s.gen(relay);
    s.report(Report::Closed {
        relay: url(relay),
        generation: g,
        sub_id: sub.clone(),
        message: message.into(),
    })
}

#[test]
fn rate_limited_closed_waits_the_cooldown_then_resubscribes() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    closed(&mut s, relay, &subs[1].0, "rate-limited: slow down");
    assert_eq!(s.m.counters().rate_limited, 1);
    // Not before 65 s ...
    assert!(subscribes(&s.advance(Duration::from_secs(60)), relay).is_empty());
    // ... then the batch's items again.
    let cmds = s.advance(Duration::from_secs(10));
    assert_eq!(subscribes(&cmds, relay).len(), 3);
}

#[test]
fn closed_layer1_is_reopened_not_silently_gone() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    let l1 = subscribes(&cmds, relay)[0].clone();
    assert!(is_l1(&l1.1));
    s.eose_all(relay, &cmds);
    closed(
        &mut s,
        relay,
        &l1.0,
        "error: shutting down idle subscriptions",
    );
    let open: Vec<_> = s.m.subscriptions(&url(relay));
    assert!(!open.iter().any(|(id, _)| *id == l1.0));
    assert!(subscribes(&s.advance(Duration::from_secs(300)), relay).is_empty());
    let closed_at = s.now.minus(Duration::from_secs(300));
    let cmds = s.advance(Duration::from_secs(301));
    let again = subscribes(&cmds, relay);
    // Live again (no since) plus a catch-up from the moment it was lost.
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|(_, f)| is_l1(f)));
    assert!(is_live_only(&again[0].1));
    assert_eq!(
        since(&again[1].1),
        Some(closed_at.minus(Duration::from_secs(900)).as_secs())
    );
    assert!(s
        .m
        .subscriptions(&url(relay))
        .iter()
        .any(|(_, p)| *p == SubPurpose::Announcements));
}

#[test]
fn refused_batch_fails_and_is_retried_much_later() {
    for prefix in [
        "restricted:",
        "blocked:",
        "invalid:",
        "unsupported:",
        "error:",
        "auth-required:",
        "weird",
    ] {
        let relay = "wss://a.example";
        let (mut s, _) = discovered(&[relay]);
        let cmds = s.connected(relay);
        eose_l1(&mut s, relay, &cmds);
        let subs = subscribes(&cmds, relay);
        closed(&mut s, relay, &subs[2].0, &format!("{prefix} no"));
        assert!(!s.m.pending_index().contains_key(&url(relay)), "{prefix}");
        assert_eq!(s.m.counters().batches_failed, 1);
        assert!(
            subscribes(&s.advance(Duration::from_secs(590)), relay).is_empty(),
            "{prefix}"
        );
        assert_eq!(
            subscribes(&s.advance(Duration::from_secs(20)), relay).len(),
            3,
            "{prefix}"
        );
    }
}

#[test]
fn rate_limit_notice_pauses_new_subscriptions() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    s.eose_all(relay, &cmds);
    let g = s.gen(relay);
    s.report(Report::Notice {
        relay: url(relay),
        generation: g,
        message: "ERROR: too many concurrent REQs".into(),
    });
    s.self_event(&issue("r", "new"));
    let cmds = s.advance(Duration::from_secs(5));
    assert!(subscribes(&cmds, relay).is_empty(), "paused");
    let cmds = s.advance(Duration::from_secs(65));
    assert_eq!(
        subscribes(&cmds, relay).len(),
        3,
        "resumed after the cool-down"
    );
    // Another kind of NOTICE changes nothing.
    s.report(Report::Notice {
        relay: url(relay),
        generation: g,
        message: "hello".into(),
    });
    assert_eq!(s.m.counters().rate_limited, 1);
}

/// Plays a relay that answers every REQ with EOSE at once; checks that the engine never has
/// more than `budget` subscriptions open on it. Returns the commands seen.
fn play_relay(
    s: &mut Sim,
    relay: &str,
    open: &mut HashSet<SubscriptionId>,
    budget: usize,
    mut cmds: Vec<Command>,
) -> Vec<Command> {
    let mut seen = vec![];
    let mut rounds = 0;
    while !cmds.is_empty() {
        rounds += 1;
        assert!(rounds < 10_000);
        let mut fresh = vec![];
        for c in &cmds {
            match c {
                Command::Subscribe {
                    relay: r, sub_id, ..
                } if r.as_str() == relay => {
                    assert!(open.insert(sub_id.clone()));
                    assert!(
                        open.len() <= budget,
                        "{} open > budget {budget}",
                        open.len()
                    );
                    fresh.push(sub_id.clone());
                }
                Command::Unsubscribe {
                    relay: r, sub_id, ..
                } if r.as_str() == relay => {
                    open.remove(sub_id);
                }
                _ => {}
            }
        }
        seen.extend(cmds);
        cmds = vec![];
        for sub_id in fresh {
            cmds.extend(s.eose(relay, sub_id, PageStats::default()));
        }
    }
    seen
}

#[test]
fn subscription_budget_is_never_exceeded_and_every_item_syncs() {
    let relay = "wss://a.example";
    let mut s = Sim::new(|c| c.default_subscription_budget = 5);
    s.own_connected();
    s.self_event(&announcement("r", &[relay], 1));
    s.advance(Duration::from_secs(5));
    let mut open = HashSet::new();
    let cmds = s.connected(relay);
    play_relay(&mut s, relay, &mut open, 5, cmds);
    let mut ids = HashSet::new();
    // 250 root events, in 25 batches of 10: 9 Layer-3 filters at the end.
    for b in 0..25 {
        for i in 0..10 {
            let e = issue("r", &format!("issue {b}/{i}"));
            ids.insert(e.id);
            s.self_event(&e);
        }
        let cmds = s.advance(Duration::from_secs(5));
        play_relay(&mut s, relay, &mut open, 5, cmds);
    }
    // Let consolidation deadlines and polls run.
    for _ in 0..10 {
        let cmds = s.advance(Duration::from_secs(30));
        play_relay(&mut s, relay, &mut open, 5, cmds);
    }
    let st = &s.m.relay_index()[&url(relay)];
    assert_eq!(st.root_events, ids, "every root event confirmed");
    assert_eq!(st.repos, [repo("r")].into());
    assert!(!s.m.pending_index().contains_key(&url(relay)));
    assert!(open.len() <= 5);
    // Live: Layer 1 + 3 queries; the other Layer-2/3 queries are polled with since.
    let cmds = s.advance(Duration::from_secs(60));
    let polls = subscribes(&cmds, relay);
    assert!(!polls.is_empty(), "a poll round runs");
    assert!(polls.iter().all(|(_, f)| since(f).is_some()));
    let mut covered: HashSet<String> = HashSet::new();
    for (_, f) in &polls {
        covered.extend(tag_values(f, "#e"));
    }
    play_relay(&mut s, relay, &mut open, 5, cmds);
    assert!(!covered.is_empty());
}

#[test]
fn nip11_max_subscriptions_sets_the_budget() {
    let relay = "wss://a.example";
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.report(Report::Limits {
        relay: url(relay),
        limits: crate::shared::limits::RelayLimits {
            max_subscriptions: Some(3),
            ..Default::default()
        },
    });
    assert_eq!(s.m.budget(&url(relay)), 3);
    s.self_event(&announcement("r", &[relay], 1));
    s.advance(Duration::from_secs(5));
    let cmds = s.connected(relay);
    // L1 + the batch's 3 filters, but only 3 at a time.
    assert_eq!(subscribes(&cmds, relay).len(), 3);
    let mut open = HashSet::new();
    play_relay(&mut s, relay, &mut open, 3, cmds);
    assert_eq!(s.m.relay_index()[&url(relay)].repos, [repo("r")].into());
}

#[test]
fn reqs_are_split_below_nip11_max_message_length() {
    let relay = "wss://a.example";
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.report(Report::Limits {
        relay: url(relay),
        limits: crate::shared::limits::RelayLimits {
            max_message_length: Some(2000),
            ..Default::default()
        },
    });
    // 60 repositories on one relay: one #a filter of 60 refs would be ~5 KB.
    for i in 0..60 {
        s.self_event(&announcement(&format!("r{i}"), &[relay], 1));
    }
    s.advance(Duration::from_secs(5));
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    let mut refs: HashSet<String> = HashSet::new();
    for (id, f) in &subs[1..] {
        let req = format!("[\"REQ\",\"{id}\",{}]", f.as_json());
        assert!(req.len() <= 2000, "REQ of {} bytes", req.len());
        refs.extend(tag_values(f, "#a"));
    }
    assert_eq!(refs.len(), 60, "every repository still asked for");
    assert!(subs.len() > 4, "split into more filters");
}

#[test]
fn self_subscription_pages_stay_within_the_own_relays_budget() {
    let mut s = Sim::new(|c| {
        c.assumed_page_size = 10;
        c.default_subscription_budget = 3;
    });
    let cmds = s.own_connected();
    let (sub, _) = subscribes(&cmds, OWN).remove(0);
    // A full page in one second: split by the filter's five kinds, plus older seconds.
    let cmds = s.eose(
        OWN,
        sub,
        PageStats {
            received: 10,
            oldest: Some(500),
            newest: Some(500),
            ..PageStats::default()
        },
    );
    let first = subscribes(&cmds, OWN);
    assert_eq!(first.len(), 2, "self-subscription + 2 pages = budget 3");
    assert_eq!(s.m.own_open_subscriptions(), 3);
    let mut total = first.len();
    let mut queue: Vec<SubscriptionId> = first.into_iter().map(|x| x.0).collect();
    while let Some(page) = queue.pop() {
        let cmds = s.eose(OWN, page, PageStats::default());
        let next = subscribes(&cmds, OWN);
        total += next.len();
        assert!(s.m.own_open_subscriptions() <= 3);
        queue.extend(next.into_iter().map(|x| x.0));
    }
    assert_eq!(
        total, 6,
        "older seconds + one query per kind, all sent in the end"
    );
}

#[test]
fn a_query_without_eose_is_sent_again_not_left_loading() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    // The batch answers; Layer 1 never does (a relay dropped it silently).
    let l1 = subscribes(&cmds, relay)[0].clone();
    let g = s.gen(relay);
    for (sub_id, _) in &subscribes(&cmds, relay)[1..] {
        s.eose(relay, sub_id.clone(), PageStats::default());
    }
    assert!(s.advance(Duration::from_secs(100)).is_empty());
    let cmds = s.advance(Duration::from_secs(30));
    assert!(cmds.contains(&Command::Unsubscribe {
        relay: url(relay),
        generation: g,
        sub_id: l1.0.clone(),
    }));
    let again = subscribes(&cmds, relay);
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].1, l1.1, "the same query");
    assert_eq!(s.m.counters().queries_resent, 1);
    // Answered this time: nothing more.
    eose_l1(&mut s, relay, &cmds);
    assert!(subscribes(&s.advance(Duration::from_secs(300)), relay).is_empty());
}

#[test]
fn during_a_rate_limit_cool_down_nothing_is_sent_to_the_relay() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    let subs = subscribes(&cmds, relay);
    let g = s.gen(relay);
    s.report(Report::Notice {
        relay: url(relay),
        generation: g,
        message: "rate limit exceeded".into(),
    });
    // Layer 1 comes back full: its next page must wait for the cool-down.
    let out = s.eose(
        relay,
        subs[0].0.clone(),
        PageStats {
            received: 20,
            oldest: Some(100),
            newest: Some(200),
            ..PageStats::default()
        },
    );
    assert!(
        subscribes(&out, relay).is_empty(),
        "held during the cool-down"
    );
    assert!(subscribes(&s.advance(Duration::from_secs(60)), relay).is_empty());
    let cmds = s.advance(Duration::from_secs(6));
    let pages = subscribes(&cmds, relay);
    assert_eq!(pages.len(), 1, "sent when the cool-down ends");
    assert_eq!(json(&pages[0].1)["until"], 100);
}

#[test]
fn no_more_remote_relays_than_max_relays() {
    let mut s = Sim::new(|c| c.max_relays = 3);
    s.own_connected();
    for i in 0..5 {
        s.self_event(&announcement(
            &format!("r{i}"),
            &[&format!("wss://r{i}.example")],
            1,
        ));
    }
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(connects(&cmds).len(), 3);
    assert_eq!(s.m.relay_index().len(), 3);
    assert_eq!(s.m.target_report().relays_over_global_cap, 2);
}

#[test]
fn eose_deadlines_are_suspended_while_the_forward_queue_is_full() {
    let relay = "wss://a.example";
    let (mut s, _) = discovered(&[relay]);
    let cmds = s.connected(relay);
    eose_l1(&mut s, relay, &cmds);
    // The batch has not seen EOSE when the own relay stops taking events.
    s.advance(Duration::from_secs(60));
    s.report(Report::ForwardBackPressure { active: true });
    let cmds = s.advance(Duration::from_secs(600));
    assert_eq!(
        unsubscribes(&cmds),
        0,
        "nothing fails while remote reading is paused"
    );
    assert_eq!(s.m.counters().batches_failed, 0);
    s.report(Report::ForwardBackPressure { active: false });
    // The deadline resumes where it stopped: 60 s were used, 60 s are left.
    assert_eq!(unsubscribes(&s.advance(Duration::from_secs(55))), 0);
    let cmds = s.advance(Duration::from_secs(10));
    assert_eq!(unsubscribes(&cmds), 3, "then the batch fails as usual");
    assert_eq!(s.m.counters().batches_failed, 1);
}

#[test]
fn rejected_events_are_retried_only_for_what_a_batch_changed() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    let retries = |cmds: &[Command]| -> Vec<Vec<String>> {
        cmds.iter()
            .filter_map(|c| match c {
                Command::RetryRejected { repos, roots } => Some(
                    repos
                        .iter()
                        .cloned()
                        .chain(roots.iter().map(|id| id.to_hex()))
                        .collect(),
                ),
                _ => None,
            })
            .collect()
    };
    s.self_event(&announcement("r", &["wss://a.example"], 10));
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(retries(&cmds), vec![vec![repo("r")]]);
    let root = issue("r", "a root");
    s.self_event(&root);
    let cmds = s.advance(Duration::from_secs(5));
    assert_eq!(retries(&cmds), vec![vec![root.id.to_hex()]]);
    // The same events read again (an own-relay reconnect re-reads everything) change
    // nothing: no retry.
    s.self_event(&announcement("r", &["wss://a.example"], 10));
    s.self_event(&root);
    let cmds = s.advance(Duration::from_secs(5));
    assert!(retries(&cmds).is_empty());
}

#[test]
fn relays_beyond_the_announcement_cap_are_counted() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    let many: Vec<String> = (0..40).map(|i| format!("wss://r{i}.example")).collect();
    let refs: Vec<&str> = many.iter().map(String::as_str).collect();
    s.self_event(&announcement("r", &refs, 10));
    s.advance(Duration::from_secs(5));
    assert_eq!(s.m.counters().announcement_relays_dropped, 8);
}

#[test]
fn root_events_are_counted_once_whatever_their_repositories_and_rereads() {
    let mut s = Sim::new(|_| {});
    s.own_connected();
    s.self_event(&announcement("r", &["wss://a.example"], 10));
    s.self_event(&announcement("q", &["wss://b.example"], 10));
    // One root of both repositories, one of r only, one naming no known repository yet.
    let both = EventBuilder::new(Kind::Custom(1621), "both")
        .tag(Tag::parse(["a", &repo("r")]).unwrap())
        .tag(Tag::parse(["a", &repo("q")]).unwrap())
        .finalize(&keys())
        .unwrap();
    s.self_event(&both);
    s.self_event(&issue("r", "only r"));
    s.self_event(&issue("later", "before its announcement"));
    s.advance(Duration::from_secs(5));
    assert_eq!(s.m.root_event_count(), 3);
    // The own relay read again (a reconnect re-reads everything): nothing new.
    s.self_event(&both);
    s.self_event(&issue("r", "only r"));
    s.advance(Duration::from_secs(5));
    assert_eq!(s.m.root_event_count(), 3);
    s.self_event(&issue("q", "a new one"));
    s.advance(Duration::from_secs(5));
    assert_eq!(s.m.root_event_count(), 4);
}
