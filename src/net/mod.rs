//! Networking: relay URLs and the blocking websocket connector.

pub mod url;
pub mod ws;
