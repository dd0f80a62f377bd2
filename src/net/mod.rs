//! Networking: relay URLs and the blocking websocket connector.

pub mod nip11;
pub mod tls;
pub mod url;
pub mod ws;
