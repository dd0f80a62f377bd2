//! Networking: the address policy and the blocking websocket connector.

pub(crate) mod inbound;
pub mod nip11;
pub mod policy;
pub(crate) mod pool;
pub mod tls;
pub mod ws;
