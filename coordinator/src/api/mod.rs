//! The HTTP API: request types, validation, OpenAI-shaped errors, handlers.

pub mod error;
pub mod handlers;
pub mod run;
pub mod types;

pub use error::ApiError;
