//! Relay frames: `parse_relay_frame`, then the event checks for an EVENT, never panic.
#![no_main]

use grasp_sync::core::message::{check_parsed, parse_event, parse_relay_frame, Incoming};
use grasp_sync::core::paging::PageStats;
use libfuzzer_sys::fuzz_target;
use nostr::filter::Filter;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
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
