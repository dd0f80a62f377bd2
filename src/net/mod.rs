//! Networking: the address policy and the blocking websocket connector.

pub mod inbound;
pub mod nip11;
pub mod policy;
pub mod pool;
pub mod tls;
pub mod ws;
