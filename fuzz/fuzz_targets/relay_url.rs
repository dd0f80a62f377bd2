//! `RelayUrl::parse` never panics, and normalisation is idempotent.
#![no_main]

use grasp_sync::RelayUrl;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(url) = RelayUrl::parse(text) {
        let again = RelayUrl::parse(url.as_str()).expect("a normalised URL parses");
        assert_eq!(again, url, "parse(normalise(x)) == normalise(x)");
        assert_eq!(again.as_str(), url.as_str());
    }
});
