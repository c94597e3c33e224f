//! Why the engine core refuses a request.

use common::RequestId;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AddRequestError {
    #[error("request {0} already exists")]
    DuplicateId(RequestId),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, but the model's maximum context length is {max_model_len}")]
    PromptTooLong { prompt: usize, max_model_len: usize },
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(#[from] common::SamplingParamsError),
}
