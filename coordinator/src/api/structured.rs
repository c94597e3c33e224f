//! Structured-output fields of a request and the one constraint they ask
//! for: OpenAI's `response_format` (`text`, `json_object`, `json_schema`),
//! vLLM's `structured_outputs` object (`json`, `regex`, `choice`,
//! `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
//! `guided_choice` and `guided_grammar` (Lark). The constraint is compiled
//! here, before dispatch, so a schema, regex or grammar llguidance rejects
//! gets a 400 naming the field and the problem; the worker compiles it
//! again for its masks.

use common::StructuredOutput;
use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use crate::app::AppState;

/// The fields, read as raw JSON so that each wrong shape gets a message
/// naming it (the body's types were checked by `validate` already).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StructuredFields {
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
}

/// A constraint and the field it came from (the `param` of its errors).
pub type Constraint = (StructuredOutput, &'static str);

impl StructuredFields {
    /// The constraint the request asks for, if any; two are a 400.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let mut found: Option<Constraint> = None;
        let mut add = |c: Option<Constraint>| -> Result<(), ApiError> {
            match (&found, c) {
                (Some((_, first)), Some((_, second))) => Err(ApiError::invalid(
                    second,
                    format!("{second} conflicts with {first}: a request may constrain its output one way only"),
                )),
                (None, c) => {
                    found = c;
                    Ok(())
                }
                (Some(_), None) => Ok(()),
            }
        };
        add(self.response_format.as_ref().map(response_format).transpose()?.flatten())?;
        if let Some(so) = &self.structured_outputs {
            let Value::Object(fields) = so else {
                return Err(ApiError::invalid("structured_outputs", "structured_outputs must be an object"));
            };
            let param = "structured_outputs";
            let mut any = false;
            for (key, value) in fields.iter().filter(|(_, v)| !v.is_null()) {
                let c = match key.as_str() {
                    "json" => json_schema(param, value)?,
                    "regex" => StructuredOutput::Regex(string(param, "structured_outputs.regex", value)?),
                    "choice" => choice(param, "structured_outputs.choice", value)?,
                    "grammar" => StructuredOutput::Lark(string(param, "structured_outputs.grammar", value)?),
                    "json_object" if value.as_bool() == Some(true) => StructuredOutput::JsonObject,
                    "json_object" => continue,
                    "structural_tag" => return Err(unsupported(param, "structured_outputs.structural_tag")),
                    // Options (disable_any_whitespace, ...) that change nothing here.
                    _ => continue,
                };
                if any {
                    return Err(ApiError::invalid(
                        param,
                        "structured_outputs must set one of json, regex, choice, grammar and json_object",
                    ));
                }
                any = true;
                add(Some((c, param)))?;
            }
        }
        if let Some(v) = &self.guided_json {
            add(Some((json_schema("guided_json", v)?, "guided_json")))?;
        }
        if let Some(v) = &self.guided_regex {
            add(Some((StructuredOutput::Regex(string("guided_regex", "guided_regex", v)?), "guided_regex")))?;
        }
        if let Some(v) = &self.guided_choice {
            add(Some((choice("guided_choice", "guided_choice", v)?, "guided_choice")))?;
        }
        if let Some(v) = &self.guided_grammar {
            add(Some((StructuredOutput::Lark(string("guided_grammar", "guided_grammar", v)?), "guided_grammar")))?;
        }
        Ok(found)
    }
}

/// Sets `params.structured_output` from the request's fields, after
/// compiling the constraint against the model's vocabulary.
pub fn constrain(
    app: &AppState,
    fields: &StructuredFields,
    params: &mut common::SamplingParams,
) -> Result<Option<&'static str>, ApiError> {
    let Some((constraint, param)) = fields.constraint()? else { return Ok(None) };
    let compiler = app.grammar_compiler().map_err(|why| ApiError::invalid(param, why.to_string()))?;
    compiler.compile(&constraint).map_err(|e| ApiError::invalid(param, format!("{param}: {e}")))?;
    params.structured_output = Some(constraint);
    Ok(Some(param))
}

/// OpenAI's `response_format`: `None` for plain text.
fn response_format(v: &Value) -> Result<Option<Constraint>, ApiError> {
    let param = "response_format";
    let kind = v.get("type").and_then(Value::as_str);
    let c = match kind {
        Some("text") => return Ok(None),
        Some("json_object") => StructuredOutput::JsonObject,
        Some("json_schema") => {
            let schema = v.get("json_schema").and_then(|s| s.get("schema")).filter(|s| !s.is_null());
            let Some(schema) = schema else {
                return Err(ApiError::invalid(param, "response_format json_schema needs json_schema.schema"));
            };
            json_schema(param, schema)?
        }
        Some(other) => {
            return Err(ApiError::invalid(
                param,
                format!("response_format type '{other}' is not supported: use text, json_object or json_schema"),
            ));
        }
        None => return Err(ApiError::invalid(param, "response_format must be an object with a type")),
    };
    Ok(Some((c, param)))
}

/// A JSON schema given as an object (or boolean), or as its JSON text.
fn json_schema(param: &'static str, v: &Value) -> Result<StructuredOutput, ApiError> {
    let schema = match v {
        Value::String(text) => serde_json::from_str::<Value>(text)
            .map_err(|e| ApiError::invalid(param, format!("{param}: the JSON schema is not valid JSON: {e}")))?,
        other => other.clone(),
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(param, format!("{param}: a JSON schema must be an object")));
    }
    Ok(StructuredOutput::JsonSchema(schema.to_string()))
}

fn string(param: &'static str, name: &str, v: &Value) -> Result<String, ApiError> {
    v.as_str().map(str::to_string).ok_or_else(|| ApiError::invalid(param, format!("{name} must be a string")))
}

fn choice(param: &'static str, name: &str, v: &Value) -> Result<StructuredOutput, ApiError> {
    let list: Option<Vec<String>> =
        v.as_array().and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect());
    match list {
        Some(list) if !list.is_empty() => Ok(StructuredOutput::Choice(list)),
        _ => Err(ApiError::invalid(param, format!("{name} must be a non-empty list of strings"))),
    }
}

fn unsupported(param: &'static str, name: &str) -> ApiError {
    ApiError::invalid(param, format!("{name} is not supported by this server"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn constraint(json: &str) -> Result<Option<Constraint>, ApiError> {
        serde_json::from_str::<StructuredFields>(json).unwrap().constraint()
    }

    #[test]
    fn every_field_maps_to_its_constraint() {
        let schema = r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#;
        for (json, want, param) in [
            (
                r#"{"response_format": {"type": "json_object"}}"#.to_string(),
                StructuredOutput::JsonObject,
                "response_format",
            ),
            (
                format!(
                    r#"{{"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}, "strict": true}}}}}}"#
                ),
                StructuredOutput::JsonSchema(schema.into()),
                "response_format",
            ),
            (format!(r#"{{"guided_json": {schema}}}"#), StructuredOutput::JsonSchema(schema.into()), "guided_json"),
            (
                format!(r#"{{"guided_json": {}}}"#, Value::from(schema)),
                StructuredOutput::JsonSchema(schema.into()),
                "guided_json",
            ),
            (r#"{"guided_regex": "a+"}"#.into(), StructuredOutput::Regex("a+".into()), "guided_regex"),
            (
                r#"{"guided_choice": ["x", "y"]}"#.into(),
                StructuredOutput::Choice(vec!["x".into(), "y".into()]),
                "guided_choice",
            ),
            (
                r#"{"guided_grammar": "start: \"a\""}"#.into(),
                StructuredOutput::Lark("start: \"a\"".into()),
                "guided_grammar",
            ),
            (
                r#"{"structured_outputs": {"regex": "b+", "disable_any_whitespace": true}}"#.into(),
                StructuredOutput::Regex("b+".into()),
                "structured_outputs",
            ),
            (
                r#"{"structured_outputs": {"json_object": true}}"#.into(),
                StructuredOutput::JsonObject,
                "structured_outputs",
            ),
            (
                r#"{"structured_outputs": {"choice": ["p"]}}"#.into(),
                StructuredOutput::Choice(vec!["p".into()]),
                "structured_outputs",
            ),
            (
                r#"{"structured_outputs": {"grammar": "start: \"a\""}}"#.into(),
                StructuredOutput::Lark("start: \"a\"".into()),
                "structured_outputs",
            ),
        ] {
            assert_eq!(constraint(&json).unwrap(), Some((want, param)), "{json}");
        }
        assert_eq!(constraint(r#"{"response_format": {"type": "text"}}"#).unwrap(), None);
        assert_eq!(constraint("{}").unwrap(), None);
        assert_eq!(
            constraint(r#"{"response_format": {"type": "text"}, "guided_regex": "a"}"#).unwrap().unwrap().1,
            "guided_regex"
        );
    }

    #[test]
    fn conflicts_and_bad_shapes_are_refused_by_name() {
        for (json, param) in [
            (r#"{"response_format": {"type": "json_object"}, "guided_regex": "a"}"#, "guided_regex"),
            (r#"{"guided_choice": ["a"], "guided_regex": "a"}"#, "guided_choice"),
            (r#"{"structured_outputs": {"regex": "a", "choice": ["a"]}}"#, "structured_outputs"),
            (r#"{"structured_outputs": {"json_object": true}, "guided_json": {}}"#, "guided_json"),
            (r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}"#, "response_format"),
            (r#"{"response_format": {"type": "yaml"}}"#, "response_format"),
            (r#"{"response_format": "json"}"#, "response_format"),
            (r#"{"guided_json": "{not json"}"#, "guided_json"),
            (r#"{"guided_json": 5}"#, "guided_json"),
            (r#"{"guided_choice": []}"#, "guided_choice"),
            (r#"{"guided_choice": [1]}"#, "guided_choice"),
            (r#"{"guided_regex": 5}"#, "guided_regex"),
            (r#"{"structured_outputs": "json"}"#, "structured_outputs"),
            (r#"{"structured_outputs": {"structural_tag": "x"}}"#, "structured_outputs"),
        ] {
            let err = constraint(json).unwrap_err();
            assert_eq!(err.param.as_deref(), Some(param), "{json}: {}", err.message);
            assert_eq!(err.status, hyper::StatusCode::BAD_REQUEST);
        }
    }
}
