//! The HTTP API: one file per endpoint family (`generate`, `completions`,
//! `chat`, `messages` for Anthropic's API, `tokenize`, `info`), over the request types and their checks
//! (`request`, `prepare`, `structured` for constrained output), the choice
//! runner (`run`), the response shapes (`openai`, `logprobs`), the SSE
//! stream (`sse`), tool calling (`tool_calls`), and OpenAI-shaped errors.

pub mod chat;
pub mod completions;
pub mod error;
mod fields;
pub mod generate;
pub mod info;
pub mod logprobs;
pub mod messages;
pub mod openai;
pub mod prepare;
pub mod reply;
pub mod request;
pub mod responses;
pub mod run;
pub mod sse;
pub mod structured;
pub mod tokenize;
pub mod tool_calls;
pub mod validate;

pub use error::ApiError;
pub use reply::Reply;
