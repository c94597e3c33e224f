//! The grammar that forces tool calls, for `tool_choice: "required"` or a
//! named function: llguidance's Lark dialect (`common::StructuredOutput::Lark`),
//! with each call's JSON given as an inline `%json` schema. The calls are
//! written in the model's own format, so the parser that reads unforced
//! calls reads these too:
//!
//! * Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`,
//!   calls joined by `\n`;
//! * Llama 3 JSON: `{"name": "f", "parameters": {...}}`, calls joined by `; `.
//!
//! Each call's schema is `{"name": {"const": f}, <key>: f's parameters}`
//! for every offered `f` (an `anyOf`), so the name is one of the tools and
//! the arguments validate against that tool's schema. JSON is written with
//! `", "` and `": "` between items and no other whitespace, as the models'
//! own examples are: a model left free to add whitespace can wander off
//! into it (llguidance's default allows any).

use serde_json::{Value, json};

use super::{Function, ToolFormat};

/// The Lark grammar of one call (`parallel` false) or one or more calls to
/// `functions` (at least one), in `format`.
pub fn call_grammar(format: ToolFormat, functions: &[&Function], parallel: bool) -> String {
    let (arguments_key, call, separator) = match format {
        ToolFormat::Hermes => ("arguments", r#""<tool_call>\n" call_json "\n</tool_call>""#, r#""\n""#),
        ToolFormat::Llama3Json => ("parameters", "call_json", r#""; ""#),
    };
    let start = if parallel { format!("call ({separator} call)*") } else { "call".to_string() };
    format!(
        "%llguidance {{}}\n\nstart: {start}\ncall: {call}\ncall_json: %json {}\n",
        call_schema(functions, arguments_key)
    )
}

/// The JSON schema of one call to any of `functions`, as compact JSON text.
/// The call's keys are written in order (name first, which the streaming
/// parser reads before the arguments): serde_json's maps would sort them.
fn call_schema(functions: &[&Function], arguments_key: &str) -> String {
    let options: Vec<String> = functions
        .iter()
        .map(|f| {
            format!(
                r#"{{"type":"object","properties":{{"name":{},"{arguments_key}":{}}},"required":["name","{arguments_key}"],"additionalProperties":false}}"#,
                json!({ "const": f.name }),
                arguments_schema(&f.parameters),
            )
        })
        .collect();
    let layout = json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": " });
    format!(r#"{{"x-guidance":{layout},"anyOf":[{}]}}"#, options.join(","))
}

/// A function's parameters as a schema for its arguments: an object, the
/// schema's own constraints applied (OpenAI's `parameters` describe an
/// object; an omitted one takes none).
fn arguments_schema(parameters: &Value) -> Value {
    match parameters {
        Value::Object(schema) if !schema.is_empty() => {
            let mut schema = schema.clone();
            schema.entry("type").or_insert_with(|| json!("object"));
            Value::Object(schema)
        }
        _ => json!({ "type": "object" }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Function {
        let parameters = json!({
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
            "required": ["city"],
        });
        Function { name: "get_weather".into(), parameters }
    }

    fn now() -> Function {
        Function { name: "now".into(), parameters: json!({}) }
    }

    /// The `%json` schema of a grammar, parsed back.
    fn schema_of(grammar: &str) -> Value {
        let line = grammar.lines().find_map(|l| l.strip_prefix("call_json: %json ")).expect("call_json line");
        serde_json::from_str(line).expect("schema is JSON")
    }

    #[test]
    fn hermes_one_call_to_one_of_the_tools() {
        let (weather, now) = (weather(), now());
        let grammar = call_grammar(ToolFormat::Hermes, &[&weather, &now], false);
        let mut lines = grammar.lines();
        assert_eq!(lines.next(), Some("%llguidance {}"));
        assert!(grammar.contains("\nstart: call\n"), "{grammar}");
        assert!(grammar.contains("\ncall: \"<tool_call>\\n\" call_json \"\\n</tool_call>\"\n"), "{grammar}");
        let schema = schema_of(&grammar);
        assert_eq!(schema["x-guidance"]["whitespace_flexible"], false);
        let options = schema["anyOf"].as_array().expect("anyOf");
        assert_eq!(options.len(), 2);
        assert_eq!(options[0]["properties"]["name"], json!({"const": "get_weather"}));
        assert_eq!(options[0]["properties"]["arguments"], weather.parameters);
        assert_eq!(options[0]["required"], json!(["name", "arguments"]));
        assert_eq!(options[0]["additionalProperties"], false);
        // No parameters: any object.
        assert_eq!(options[1]["properties"]["arguments"], json!({"type": "object"}));
        // The name is written (and so generated) before the arguments.
        let text = grammar.lines().last().expect("last line");
        assert!(text.find(r#""name":{"const":"now"}"#) < text.rfind(r#""arguments":{"type":"object"}"#), "{text}");
    }

    #[test]
    fn parallel_calls_repeat_with_the_formats_separator() {
        let weather = weather();
        let hermes = call_grammar(ToolFormat::Hermes, &[&weather], true);
        assert!(hermes.contains("\nstart: call (\"\\n\" call)*\n"), "{hermes}");
        let llama = call_grammar(ToolFormat::Llama3Json, &[&weather], true);
        assert!(llama.contains("\nstart: call (\"; \" call)*\n"), "{llama}");
        assert!(llama.contains("\ncall: call_json\n"), "{llama}");
        let option = &schema_of(&llama)["anyOf"][0];
        assert_eq!(option["properties"]["parameters"], weather.parameters);
        assert_eq!(option["required"], json!(["name", "parameters"]));
    }

    #[test]
    fn schemas_without_a_type_are_objects() {
        assert_eq!(arguments_schema(&json!({"properties": {}})), json!({"type": "object", "properties": {}}));
        assert_eq!(arguments_schema(&Value::Null), json!({"type": "object"}));
    }
}
