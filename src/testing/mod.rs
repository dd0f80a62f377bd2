//! Test support: a scriptable in-process NIP-01 relay
//! ([`TestRelay`](crate::testing::TestRelay)), relay profiles that make it behave like real
//! relay software ([`Profile`](crate::testing::Profile)) and a polling helper
//! ([`wait_until`](crate::testing::wait_until)).
//!
//! Enabled by the `testing` feature. Everything runs on plain blocking threads;
//! no async runtime is involved.
//!
//! ```
//! use std::time::Duration;
//! use grasp_sync::testing::{wait_until, TestRelay};
//!
//! let relay = TestRelay::start();
//! let (mut ws, _) = tungstenite::connect(relay.url()).unwrap();
//! ws.send(tungstenite::Message::text(r#"["REQ","s",{"kinds":[1]}]"#)).unwrap();
//! let eose = ws.read().unwrap();
//! assert_eq!(eose.to_text().unwrap(), r#"["EOSE","s"]"#);
//! assert!(wait_until(Duration::from_secs(5), || relay.open_subscriptions() == 1));
//! assert_eq!(relay.reqs().len(), 1);
//! ```

use std::thread;
use std::time::{Duration, Instant};

pub mod internals;
mod ngit;
mod nip11;
mod nip77;
mod policy;
mod profile;
mod relay;
pub mod tls;

pub use self::ngit::NgitGraspPolicy;
pub use self::nip77::{Nip77Mode, RecordedNegOpen};
pub use self::policy::{GraspPolicy, Refill, WriteRate};
pub use self::profile::Profile;
pub use self::relay::{RecordedReq, Reply, TestRelay, TestRelayOptions};

/// Polls `cond` every 10 ms until it returns `true` (then returns `true`) or
/// `deadline` has passed (then returns `false`). `cond` is always called at
/// least once, and once more after the deadline.
pub fn wait_until(deadline: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + deadline;
    loop {
        if cond() {
            return true;
        }
        let now = Instant::now();
        if now >= end {
            return false;
        }
        thread::sleep((end - now).min(Duration::from_millis(10)));
    }
}
