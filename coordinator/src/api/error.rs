//! Errors as OpenAI's API returns them:
//! `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status,
//! or, on Anthropic's endpoints (`/v1/messages`), as Anthropic's does:
//! `{"type": "error", "error": {"type", "message"}}`.

use hyper::StatusCode;
use serde::Serialize;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds, for 429.
    pub retry_after: Option<u64>,
}

/// The JSON an error is sent as (a response body, or a stream's last event).
#[derive(Serialize)]
pub struct ErrorBody<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// A sampling rule broken (`common::sampling::rules`): a 400 naming the
/// parameter.
impl From<common::sampling::SamplingParamsError> for ApiError {
    fn from(e: common::sampling::SamplingParamsError) -> Self {
        Self::invalid(e.param, e.message)
    }
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self { param: Some(param.into()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn model_not_found(model: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("The model `{}` does not exist.", clip(model)),
            )
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("No route for {}", clip(path)))
    }

    pub fn method_not_allowed() -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "Method not allowed")
    }

    pub fn unauthorized() -> Self {
        Self {
            code: Some("invalid_api_key"),
            ..Self::new(StatusCode::UNAUTHORIZED, "authentication_error", "Missing or incorrect API key.")
        }
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("Request body exceeds {limit} bytes."),
        )
    }

    /// 408: the request's body did not arrive in time.
    pub fn body_timeout(seconds: u64) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("The request body did not arrive within {seconds} s."),
        )
    }

    /// 431, for headers over our limit (larger ones hyper refuses itself).
    pub fn headers_too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, "invalid_request_error", message)
    }

    pub fn uri_too_long(limit: usize) -> Self {
        Self::new(StatusCode::URI_TOO_LONG, "invalid_request_error", format!("The URI exceeds {limit} bytes."))
    }

    /// 409: what the request asks conflicts with one running now.
    pub fn conflict(param: &str, message: impl Into<String>) -> Self {
        Self { param: Some(param.to_string()), ..Self::new(StatusCode::CONFLICT, "invalid_request_error", message) }
    }

    /// 422: well-formed, but not what this key was used for.
    pub fn unprocessable(param: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.to_string()),
            ..Self::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request_error", message)
        }
    }

    pub fn unsupported_media_type(given: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("Content-Type must be application/json, got {given:?}."),
        )
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self { retry_after: Some(1), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message) }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message) }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn to_body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: Inner { message: &self.message, kind: self.kind, param: self.param.as_deref(), code: self.code },
        }
    }

    /// Anthropic's shape: its error type is the status's.
    pub fn anthropic_body(&self) -> serde_json::Value {
        let kind = match self.status.as_u16() {
            400 | 405 | 408 | 415 | 422 | 431 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 | 414 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        let message = match &self.param {
            Some(param) if !self.message.contains(param.as_str()) => format!("{param}: {}", self.message),
            _ => self.message.clone(),
        };
        serde_json::json!({"type": "error", "error": {"type": kind, "message": message}})
    }

    pub fn body(&self) -> String {
        serde_json::to_string(&self.to_body()).unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#.into()
        })
    }
}

/// A client's string as quoted back in a message: a 4 MB model name is not
/// worth sending back.
fn clip(s: &str) -> String {
    const MAX_CHARS: usize = 200;
    match s.char_indices().nth(MAX_CHARS) {
        Some((end, _)) => format!("{}...", &s[..end]),
        None => s.to_string(),
    }
}
