//! NIP-34: announcement, root-event and reply classification of arbitrary events never
//! panics, the relay cap per announcement holds, and a reply names at most
//! `MAX_REPLY_REFS` other events.
#![no_main]

use arbitrary::Arbitrary;
use grasp_sync::core::nip34::{classify_self_event_with, parse_repo_coordinate, SelfEventMeaning};
use grasp_sync::RelayUrl;
use libfuzzer_sys::fuzz_target;
use nostr::event::{Event, EventId, Kind, Signature, Tag};
use nostr::key::PublicKey;
use nostr::types::Timestamp;

#[derive(Debug, Arbitrary)]
struct Input {
    kind: u16,
    created_at: u64,
    pubkey: [u8; 32],
    tags: Vec<Vec<String>>,
    content: String,
    cap: u8,
    own: Vec<String>,
    coordinate: String,
}

fuzz_target!(|input: Input| {
    let _ = parse_repo_coordinate(&input.coordinate);
    let pubkey = PublicKey::from_slice(&input.pubkey).unwrap_or_else(|_| {
        PublicKey::from_hex("79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798")
            .unwrap()
    });
    let tags: Vec<Tag> = input
        .tags
        .iter()
        .filter_map(|t| Tag::parse(t).ok())
        .collect();
    let sig = Signature::from_slice(&[1u8; 64]).unwrap();
    let event = Event::new(
        EventId::from_byte_array([0; 32]),
        pubkey,
        Timestamp::from_secs(input.created_at),
        Kind::from(input.kind),
        tags,
        input.content,
        sig,
    );
    let own: Vec<RelayUrl> = input
        .own
        .iter()
        .filter_map(|u| RelayUrl::parse(u).ok())
        .collect();
    let cap = input.cap as usize;
    match classify_self_event_with(&event, cap, &own) {
        SelfEventMeaning::Announcement(a) => {
            let others = a.relays.iter().filter(|r| !own.contains(r)).count();
            assert!(others <= cap, "{others} relays over the cap {cap}");
            assert!(a.repo_ref.starts_with("30617:"));
        }
        SelfEventMeaning::RootEvent { repos, .. } => {
            for r in repos {
                assert_eq!(parse_repo_coordinate(&r).as_deref(), Some(r.as_str()));
            }
        }
        SelfEventMeaning::Reply { id, parents, .. } => {
            assert!(!parents.is_empty());
            assert!(parents.len() <= grasp_sync::core::threads::MAX_REPLY_REFS);
            assert!(!parents.contains(&id), "an event is not its own parent");
            assert_ne!(event.kind.as_u16(), 5, "a deletion is not followed");
        }
        // `SelfEventMeaning` is `#[non_exhaustive]`: a new meaning is checked here once added.
        _ => {}
    }
});
