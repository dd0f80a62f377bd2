//! NIP-11: the HTTP response reader and the document parser never panic.
#![no_main]

use grasp_sync::net::nip11::{parse_http_response, parse_limits};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(limits) = parse_limits(data) {
        let _ = limits.page_size(20);
        let _ = limits.subscription_budget(20);
    }
    if let Ok(body) = parse_http_response(data) {
        let _ = parse_limits(&body);
    }
});
