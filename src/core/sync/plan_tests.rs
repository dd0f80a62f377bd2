//! Planning cost: an `#[ignore]`d timing that prints (never asserts) how long planning takes
//! at 1k/10k/100k repositories, and the check that the cached targets always equal a fresh
//! derivation.
//!
//! ```sh
//! nice cargo test --release --lib plan_timing -- --ignored --nocapture
//! ```

use std::time::Instant;

use nostr::event::EventId;

use super::machine_targets;
use crate::core::nip34::{Announcement, SelfEventMeaning};
use crate::core::state::ConnectionStatus;
use crate::core::sync::{SyncConfig, SyncMachine};
use crate::core::time::Time;
use crate::shared::RelayUrl;

fn url(s: &str) -> RelayUrl {
    RelayUrl::parse(s).unwrap()
}

fn repo_ref(key: usize, d: usize) -> String {
    format!("30617:{key:064x}:r{d}")
}

fn root_id(n: u64) -> EventId {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&n.to_be_bytes());
    b[8] = 0x5a;
    EventId::from_byte_array(b)
}

/// Feeds `meanings` as one self-subscription batch.
fn batch(m: &mut SyncMachine, meanings: Vec<SelfEventMeaning>, now: Time) {
    m.batch.meanings.extend(meanings);
    m.process_batch(now);
    while m.poll_command().is_some() {}
}

/// A machine with `repos` repositories (10 per pubkey) naming 3 of `relays` relays each and
/// `roots_per_repo` root events each, every relay connected with everything confirmed.
fn big_machine(repos: usize, relays: usize, roots_per_repo: usize) -> SyncMachine {
    let mut c = SyncConfig::new(url("ws://own.example"));
    c.max_relays = relays.max(1000);
    let mut m = SyncMachine::new(c);
    let now = Time::from_secs(1_700_000_000);
    m.start(now);
    let urls: Vec<RelayUrl> = (0..relays)
        .map(|i| url(&format!("wss://relay{i}.example")))
        .collect();
    let mut meanings = Vec::new();
    let mut next_root = 0u64;
    for r in 0..repos {
        let repo = repo_ref(r / 10, r);
        meanings.push(SelfEventMeaning::Announcement(Announcement {
            repo_ref: repo.clone(),
            relays: (0..3)
                .map(|k| urls[(r * 7 + k * 13) % relays].clone())
                .collect(),
            created_at: 1,
            dropped_relays: 0,
        }));
        for _ in 0..roots_per_repo {
            next_root += 1;
            meanings.push(SelfEventMeaning::RootEvent {
                id: root_id(next_root),
                repos: vec![repo.clone()],
            });
        }
    }
    batch(&mut m, meanings, now);
    // Every relay connected and fully synced: planning must diff the whole target.
    let targets = machine_targets(&m.repo_index, &m.excluded, &m.config).targets;
    for (u, r) in m.remotes.iter_mut() {
        r.state.connection_status = ConnectionStatus::Connected;
        if let Some(t) = targets.get(u) {
            r.state.repos = t.repos.clone();
            r.state.root_events = t.root_events.clone();
        }
        r.pending.clear();
    }
    m
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1000.0
}

#[test]
#[ignore = "timing: run in release with --ignored --nocapture"]
fn plan_timing() {
    // PLAN_SIZES=100000 picks sizes; every figure is the best of 5 runs (shared machines).
    let sizes: Vec<usize> = std::env::var("PLAN_SIZES")
        .map(|s| s.split(',').map(|n| n.trim().parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![1_000, 10_000, 100_000]);
    let best = |f: &mut dyn FnMut() -> f64| (0..5).map(|_| f()).fold(f64::MAX, f64::min);
    for repos in sizes {
        let mut m = big_machine(repos, 1000, 10);
        let now = Time::from_secs(1_700_000_100);
        let (mut derive, mut compute, mut n) = (f64::MAX, f64::MAX, 0);
        for _ in 0..3 {
            let t = Instant::now();
            let full = machine_targets(&m.repo_index, &m.excluded, &m.config);
            derive = derive.min(ms(t));
            let t = Instant::now();
            n = full
                .targets
                .iter()
                .filter_map(|(u, t)| {
                    let r = &m.remotes.get(u);
                    crate::core::targets::compute_action(
                        u,
                        t,
                        r.map(|r| &r.state),
                        r.map_or(&[], |r| &r.pending),
                    )
                })
                .count();
            compute = compute.min(ms(t));
        }
        let victim = repo_ref(3, 33);
        let mut k = 0u64;
        let one_root = best(&mut || {
            k += 1;
            let t = Instant::now();
            batch(
                &mut m,
                vec![SelfEventMeaning::RootEvent {
                    id: root_id(u64::MAX - k),
                    repos: vec![victim.clone()],
                }],
                now,
            );
            ms(t)
        });
        let mut created = 1u64;
        let announce = best(&mut || {
            created += 1;
            let other = if created.is_multiple_of(2) {
                "wss://new.example"
            } else {
                "wss://relay2.example"
            };
            let t = Instant::now();
            batch(
                &mut m,
                vec![SelfEventMeaning::Announcement(Announcement {
                    repo_ref: victim.clone(),
                    relays: vec![url("wss://relay1.example"), url(other)],
                    created_at: created,
                    dropped_relays: 0,
                })],
                now,
            );
            ms(t)
        });
        let mut statuses = 0;
        let status = best(&mut || {
            let t = Instant::now();
            statuses = m.relay_statuses(now).len();
            ms(t)
        });
        let disconnects = best(&mut || {
            let t = Instant::now();
            m.check_disconnects(now);
            ms(t)
        });
        println!(
            "repos {repos:>6}, relays 1000, roots {:>7}: derive_targets {derive:8.2} ms, \
             compute_actions (all) {compute:8.2} ms ({n} actions), batch of one root event \
             {one_root:8.3} ms, batch of one announcement {announce:8.2} ms, relay_statuses \
             {status:8.3} ms ({statuses} relays), check_disconnects {disconnects:8.3} ms",
            repos * 10
        );
    }
}
