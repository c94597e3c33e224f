//! A JSON body's fields read one by one, by type, for the agent APIs
//! (`/v1/messages`, `/v1/responses`), whose bodies are read by hand rather
//! than by serde: absent and `null` are the same, and a value of the wrong
//! type is a 400 naming the field.

use serde_json::Value;

use super::error::ApiError;

#[derive(Clone, Copy)]
pub(super) struct Fields<'a>(pub &'a Value);

impl<'a> Fields<'a> {
    /// The field's value, unless absent or `null`.
    pub fn get(self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    pub fn string(self, name: &str) -> Result<Option<String>, ApiError> {
        self.typed(name, "a string", |v| v.as_str().map(str::to_string))
    }

    pub fn int(self, name: &str) -> Result<Option<i64>, ApiError> {
        self.typed(name, "an integer", Value::as_i64)
    }

    pub fn number(self, name: &str) -> Result<Option<f64>, ApiError> {
        self.typed(name, "a number", Value::as_f64)
    }

    pub fn boolean(self, name: &str) -> Result<Option<bool>, ApiError> {
        self.typed(name, "a boolean", Value::as_bool)
    }

    fn typed<T>(self, name: &str, what: &str, read: impl Fn(&Value) -> Option<T>) -> Result<Option<T>, ApiError> {
        self.get(name)
            .map(|v| read(v).ok_or_else(|| ApiError::invalid(name, format!("{name} must be {what}"))))
            .transpose()
    }
}
