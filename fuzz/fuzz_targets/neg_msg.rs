//! A relay's `NEG-MSG` text through [`NegClient::round`], the one function the sync machine
//! hands it to: never panics, whatever the text and the own side; an error adds no ids;
//! the ids claimed are bounded by what the message can name.
#![no_main]

use arbitrary::Arbitrary;
use grasp_sync::core::sync::NegClient;
use libfuzzer_sys::fuzz_target;
use nostr::event::EventId;

#[derive(Debug, Arbitrary)]
struct Input {
    own: Vec<(u32, [u8; 32])>,
    frame: u16,
    /// Messages of successive rounds (hex or not).
    messages: Vec<String>,
    /// Raw bytes sent as hex (valid hex, arbitrary negentropy content).
    raw: Vec<Vec<u8>>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fuzz_target!(|input: Input| {
    let own: Vec<(u64, EventId)> = input
        .own
        .iter()
        .take(1_000)
        .map(|(t, id)| (u64::from(*t), EventId::from_byte_array(*id)))
        .collect();
    let frame = 4_096 + u64::from(input.frame);
    let Ok((mut client, first)) = NegClient::new(&own, frame) else {
        return;
    };
    assert!(first.len() % 2 == 0);
    let texts = input
        .messages
        .iter()
        .cloned()
        .chain(input.raw.iter().map(|r| hex(r)));
    for text in texts.take(16) {
        let (mut have, mut need) = (Vec::new(), Vec::new());
        match client.round(&text, Some(&mut have), &mut need) {
            Err(_) => assert!(need.is_empty() && have.is_empty()),
            Ok(next) => {
                // A message names at most one id per 32 bytes of it.
                assert!(need.len() <= text.len() / 64 + 1);
                if let Some(n) = next {
                    assert!(n.len() % 2 == 0);
                }
            }
        }
    }
});
