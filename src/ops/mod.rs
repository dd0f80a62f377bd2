//! The operator's surface: Prometheus metrics, the `/status` document, the status page and
//! `/healthz`, served by a small blocking HTTP listener (`--metrics-addr`).
//!
//! [`render`] holds pure renderers of a [`crate::Status`]; [`http`] serves them.

pub mod audit;
pub mod http;
pub mod once;
pub mod render;

pub use http::{serve, serve_with, HttpCounters, HttpLimits, HttpServer, StatusSource};
