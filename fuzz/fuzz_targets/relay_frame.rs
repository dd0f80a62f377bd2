//! Relay frames: `parse_relay_frame`, then the event checks for an EVENT, never panic; the
//! id read without parsing (`claimed_id`) is the parsed id whenever both read one.
#![no_main]

use grasp_sync::core::message::{
    check_parsed, claimed_id, parse_event, parse_relay_frame, Incoming,
};
use grasp_sync::core::paging::PageStats;
use libfuzzer_sys::fuzz_target;
use nostr::filter::Filter;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let claimed = claimed_id(text);
    if let (Some(claimed), Ok(event)) = (claimed, parse_event(text)) {
        assert_eq!(claimed, event.id, "claimed and parsed ids differ");
    }
    if let Ok(Incoming::Event { raw, .. }) = parse_relay_frame(text) {
        if let Ok(event) = parse_event(raw.get()) {
            let mut stats = PageStats::default();
            match check_parsed(&event, &Filter::new()) {
                Ok(()) => stats.record_event(&event),
                Err(_) => stats.record_rejected(),
            }
        }
    }
});
