//! `grasp-sync audit` (the binary) against in-process test relays on 127.0.0.1: a known gap
//! is found by REQ and by NIP-77 and closed by `--fix`; relays not reached are reported; an
//! own relay that cannot be read exits 2. The same gap against real relays:
//! `tests/interop.rs` (nostr-rs-relay) and `tests/nip77_interop.rs` (rust-nostr's LocalRelay).

mod common;

use std::collections::HashSet;
use std::net::TcpListener;
use std::process::Command;

use grasp_sync::testing::{Nip77Mode, TestRelay};
use nostr::event::FinalizeEvent;
use nostr::key::Keys;

use common::*;

fn seed(relay: &TestRelay, events: &[nostr::event::Event]) {
    for e in events {
        relay.insert(e);
    }
}

/// A port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn audit_help_names_its_flags_and_exit_statuses() {
    let out = Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
        .args(["audit", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8(out.stdout).unwrap();
    for needle in [
        "Usage: grasp-sync audit",
        "--json",
        "--fix",
        "Exit status: 0",
    ] {
        assert!(help.contains(needle), "{needle:?} missing from:\n{help}");
    }
}

#[test]
fn an_own_relay_that_cannot_be_read_exits_2() {
    let out = Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
        .args(["audit", "--own-relay"])
        .arg(format!("ws://127.0.0.1:{}", closed_port()))
        .args(["--connect-timeout", "5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot read the own relay"), "{stderr}");
    let out = Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
        .args(["audit", "--own-relay", "not a url"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "bad input");
}

#[test]
fn a_gap_read_by_req_is_found_and_closed_by_fix() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    audit_fix_and_check(&own.url(), &gap, "req", &|| own.event_ids());
}

#[test]
fn a_gap_reconciled_by_nip77_is_found_and_closed_by_fix() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    remote.set_nip77(Nip77Mode::On);
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    audit_fix_and_check(&own.url(), &gap, "nip77", &|| own.event_ids());
}

#[test]
fn a_relay_not_reached_is_reported_and_the_rest_is_audited() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let keys = Keys::generate();
    let dead = format!("ws://127.0.0.1:{}", closed_port());
    let gap = audit_gap(&keys, &remote.url());
    // The announcement lists a second relay nothing listens on.
    let ann = announcement(&keys, "audited", &[&[&remote.url(), &dead]]);
    seed(&own, std::slice::from_ref(&ann));
    seed(&own, &gap.own[1..]);
    seed(&remote, &gap.remote);
    let (code, doc) = run_audit(&own.url(), &["--connect-timeout", "5"]);
    assert_eq!(code, 1, "the remote's gap: {doc:#}");
    assert_eq!(audit_missing_ids(&doc), gap.missing);
    let states: HashSet<(String, String)> = doc["relays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["url"].as_str().unwrap().trim_end_matches('/').to_string(),
                r["state"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert!(
        states.contains(&(dead.clone(), "unreachable".into())),
        "{doc:#}"
    );
    assert!(
        states.contains(&(
            remote.url().trim_end_matches('/').to_string(),
            "complete".into()
        )),
        "{doc:#}"
    );
    assert_eq!(doc["relays_with_problems"], 1);
}

#[test]
fn forged_events_are_counted_as_rejected_not_missing() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let keys = Keys::generate();
    let gap = audit_gap(&keys, &remote.url());
    seed(&own, &gap.own);
    // The remote holds what the own relay holds, plus replies whose signature or content
    // was tampered with.
    seed(&remote, &gap.own);
    let issue = &gap.own[1];
    remote
        .insert_raw(&forge_signature(&comment(&keys, issue, "forged signature")))
        .unwrap();
    remote
        .insert_raw(&forge_content(
            &comment(&keys, issue, "x"),
            "changed content",
        ))
        .unwrap();
    let (code, doc) = run_audit(&own.url(), &[]);
    assert_eq!(code, 0, "nothing genuine is missing: {doc:#}");
    // Each reply is sent twice: for the `#e` and for the `#E` query.
    assert_eq!(doc["relays"][0]["rejected"], 4, "{doc:#}");
    assert_eq!(doc["missing"], 0);
}

#[test]
fn relays_on_private_addresses_are_refused_without_allow_private_relays() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    let out = Command::new(env!("CARGO_BIN_EXE_grasp-sync"))
        .args(["audit", "--own-relay", &own.url()])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout);
    eprintln!("{table}");
    assert_eq!(out.status.code(), Some(0), "nothing read, nothing missing");
    assert!(table.contains("UNREACHABLE"), "{table}");
    assert!(table.contains("refused by the address policy"), "{table}");
    assert!(table.contains(":audited"), "the repository's line: {table}");
    assert_eq!(
        remote.connections_accepted(),
        0,
        "no connection reached the remote"
    );
}

#[test]
fn missing_events_beyond_max_missing_are_counted_and_fixed_by_the_next_run() {
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    let before = own.event_ids();
    let (code, doc) = run_audit(&own.url(), &["--max-missing", "2", "--fix"]);
    assert_eq!(code, 1, "some are still missing: {doc:#}");
    assert_eq!(doc["fix"]["accepted"], 2, "{doc:#}");
    assert!(doc["not_kept"].as_u64().unwrap() >= 1, "{doc:#}");
    let mut runs = 1;
    loop {
        let (code, doc) = run_audit(&own.url(), &["--max-missing", "2", "--fix"]);
        runs += 1;
        if code == 0 {
            break;
        }
        assert!(runs < 5, "still missing after {runs} runs: {doc:#}");
    }
    let expected: HashSet<_> = before.union(&gap.missing).copied().collect();
    assert_eq!(own.event_ids(), expected);
}

#[test]
fn a_state_older_than_the_own_relays_and_states_of_other_authors_are_not_missing() {
    // Issue 34: state events (kind 30618) are audited by their repository's coordinate. The
    // own relay holds a newer state of the repository than the remote (addressable events
    // replace each other), and the remote holds a state of the same `d` by another key.
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let keys = Keys::generate();
    let ann = announcement(&keys, "kept", &[&[&remote.url()]]);
    let old = common::event(
        &keys,
        30618,
        "",
        &[&["d", "kept"], &["HEAD", "ref: refs/heads/old"]],
    );
    let newer = nostr::event::EventBuilder::new(nostr::event::Kind::Custom(30618), "")
        .tag(nostr::event::Tag::parse(["d", "kept"]).unwrap())
        .custom_created_at(nostr::types::Timestamp::from_secs(
            old.created_at.as_secs() + 60,
        ))
        .finalize(&keys)
        .unwrap();
    let foreign = repo_state(&Keys::generate(), "kept");
    seed(&own, &[ann.clone(), newer]);
    seed(&remote, &[ann, old, foreign]);
    let (code, doc) = run_audit(&own.url(), &[]);
    assert_eq!(code, 0, "nothing missing: {doc:#}");
    assert!(audit_missing_ids(&doc).is_empty(), "{doc:#}");
}

#[test]
fn the_whole_audit_ends_by_its_deadline_however_slow_the_relays() {
    // Issue 36, item 13: each relay had 10 minutes of its own, so a few slow relays made an
    // audit last hours. `--deadline` bounds the whole run: a relay that never ends its
    // answers (EOSE withheld) is reported incomplete when it passes.
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    remote.set_withhold_eose(true);
    let started = std::time::Instant::now();
    let (_, doc) = run_audit(&own.url(), &["--deadline", "3", "--eose-timeout", "60"]);
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
    let state = doc["relays"][0]["state"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_ne!(state, "complete", "{doc:#}");
}

#[test]
fn an_audit_answers_one_auth_challenge_per_connection() {
    // Issue 36, item 13: every challenge was signed, so a relay could make the audit sign one
    // per frame. A relay that requires AUTH and sends a new challenge every 5 ms while the
    // audit reads it gets one AUTH per connection, and the audit still completes.
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let gap = audit_gap(&Keys::generate(), &remote.url());
    seed(&own, &gap.own);
    seed(&remote, &gap.remote);
    remote.set_require_auth(true);
    remote.set_eose_delay(Some(std::time::Duration::from_millis(100)));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spam = {
        let (flag, url) = (stop.clone(), remote.url());
        let remote = &remote;
        std::thread::scope(|s| {
            let h = s.spawn(move || {
                let mut n = 0u64;
                while !flag.load(std::sync::atomic::Ordering::SeqCst) {
                    remote.send_auth(&format!("challenge-{n}"));
                    n += 1;
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                n
            });
            let (code, doc) = run_audit(&own.url(), &[]);
            stop.store(true, std::sync::atomic::Ordering::SeqCst);
            let sent = h.join().unwrap();
            (code, doc, sent, url)
        })
    };
    let (code, doc, sent, _) = spam;
    assert!(sent > 10, "{sent} challenges sent");
    assert_eq!(code, 1, "the gap is found: {doc:#}");
    assert_eq!(audit_missing_ids(&doc), gap.missing, "{doc:#}");
    let answered = remote.auth_messages_received();
    let connections = remote.connections_accepted();
    assert!(
        answered >= 1 && answered <= connections,
        "{answered} AUTH messages over {connections} connections, {sent} challenges"
    );
}

#[test]
fn an_audit_finds_the_events_beyond_a_cap_a_relay_does_not_publish() {
    // Issue 36, item 7: a relay publishing no limits (no NIP-11) that returns at most 10
    // events per query, below the 20 assumed. Every page it returned was short of 20, so
    // the audit read each query as complete and found 10 of the 35 issues missing, saying
    // nothing of the rest. Its first page of 10 is probed; the probe brings older events, so
    // the cap is learnt and every issue is found (decision 0103).
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    remote.set_result_cap(Some(10));
    let keys = Keys::generate();
    let ann = announcement(&keys, "capped", &[&[&remote.url()]]);
    let repo = repo_ref(&keys, "capped");
    let t0 = nostr::types::Timestamp::now().as_secs() - 86_400;
    let issues: Vec<nostr::event::Event> = (0..35u64)
        .map(|i| {
            nostr::event::EventBuilder::new(nostr::event::Kind::Custom(1621), format!("issue {i}"))
                .tag(nostr::event::Tag::parse(["a", repo.as_str()]).unwrap())
                .custom_created_at(nostr::types::Timestamp::from_secs(t0 + i * 60))
                .finalize(&keys)
                .unwrap()
        })
        .collect();
    seed(&own, std::slice::from_ref(&ann));
    seed(&remote, std::slice::from_ref(&ann));
    seed(&remote, &issues);
    let (code, doc) = run_audit(&own.url(), &[]);
    assert_eq!(code, 1, "issues are missing: {doc:#}");
    let want: HashSet<nostr::event::EventId> = issues.iter().map(|e| e.id).collect();
    assert_eq!(audit_missing_ids(&doc), want, "{doc:#}");
    let relay = &doc["relays"][0];
    assert_eq!(relay["state"], "complete", "{doc:#}");
    assert_eq!(relay["learned_cap"], 10, "{doc:#}");
}

/// A legacy NIP-10 reply (kind 1) that tags only its parent.
fn reply_to_only(keys: &Keys, parent: &nostr::event::Event, text: &str) -> nostr::event::Event {
    common::event(keys, 1, text, &[&["e", &parent.id.to_hex(), "", "reply"]])
}

#[test]
fn a_missing_reply_three_generations_down_is_found_and_fixed() {
    // Issue 34: the audit relates what the daemon relates. The own relay holds an issue and
    // two generations of replies below it, each tagging only its parent; the remote also
    // holds the third generation, related only through the chain.
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let keys = Keys::generate();
    let ann = announcement(&keys, "chains", &[&[&remote.url()]]);
    let repo = repo_ref(&keys, "chains");
    let issue = root(&keys, 1621, &repo, "an issue", &[]);
    let first = reply_to_only(&keys, &issue, "generation 1");
    let second = reply_to_only(&keys, &first, "generation 2");
    let third = reply_to_only(&keys, &second, "generation 3, only on the remote");
    let unrelated = reply_to_only(&keys, &note(&keys, "elsewhere"), "unrelated");
    seed(
        &own,
        &[ann.clone(), issue.clone(), first.clone(), second.clone()],
    );
    seed(
        &remote,
        &[ann, issue, first, second, third.clone(), unrelated],
    );
    let before = own.event_ids();
    let (code, doc) = run_audit(&own.url(), &[]);
    assert_eq!(code, 1, "the third generation is missing: {doc:#}");
    assert_eq!(
        audit_missing_ids(&doc),
        HashSet::from([third.id]),
        "{doc:#}"
    );
    // Followed: the two replies the own relay holds, and the missing one as if stored (the
    // audit asked again for its replies: none).
    assert_eq!(doc["thread_events"], 3, "{doc:#}");
    let (code, doc) = run_audit(&own.url(), &["--fix"]);
    assert_eq!(code, 0, "--fix stored it: {doc:#}");
    assert_eq!(doc["fix"]["accepted"], 1, "{doc:#}");
    let mut want = before;
    want.insert(third.id);
    assert_eq!(own.event_ids(), want, "the own relay after --fix");
}

#[test]
fn replies_missing_two_generations_deep_are_found_one_round_each() {
    // The own relay holds the issue and one reply; the remote holds two more generations:
    // the second is related through the first, the third only once the second is counted
    // as stored (the audit asks again with it).
    let (own, remote) = (TestRelay::start(), TestRelay::start());
    let keys = Keys::generate();
    let ann = announcement(&keys, "deep", &[&[&remote.url()]]);
    let repo = repo_ref(&keys, "deep");
    let issue = root(&keys, 1621, &repo, "an issue", &[]);
    let first = reply_to_only(&keys, &issue, "generation 1");
    let second = reply_to_only(&keys, &first, "generation 2, only on the remote");
    let third = reply_to_only(&keys, &second, "generation 3, only on the remote");
    seed(&own, &[ann.clone(), issue.clone(), first.clone()]);
    seed(&remote, &[ann, issue, first, second.clone(), third.clone()]);
    let (code, doc) = run_audit(&own.url(), &[]);
    assert_eq!(code, 1, "{doc:#}");
    assert_eq!(
        audit_missing_ids(&doc),
        HashSet::from([second.id, third.id]),
        "{doc:#}"
    );
}
