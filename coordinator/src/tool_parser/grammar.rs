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
//! the arguments validate against that tool's schema (closed to other keys
//! unless it allows them: see `arguments_schema`). JSON is written with
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

/// A function's parameters as a schema for its arguments: an object with
/// the properties it declares and no others unless it allows them
/// (`additionalProperties` absent means false here, as in llama.cpp's
/// tool grammars: a forced call carries the function's arguments, not
/// whatever keys a model makes up). Omitted parameters take no arguments.
fn arguments_schema(parameters: &Value) -> Value {
    let mut schema = match parameters {
        Value::Object(schema) => schema.clone(),
        _ => Default::default(),
    };
    schema.entry("type").or_insert_with(|| json!("object"));
    schema.entry("additionalProperties").or_insert(json!(false));
    if !schema.contains_key("properties") && schema["additionalProperties"] == false {
        schema.insert("properties".into(), json!({}));
    }
    Value::Object(schema)
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
        let mut arguments = weather.parameters.clone();
        arguments["additionalProperties"] = json!(false);
        assert_eq!(options[0]["properties"]["arguments"], arguments);
        assert_eq!(options[0]["required"], json!(["name", "arguments"]));
        assert_eq!(options[0]["additionalProperties"], false);
        // No parameters: no arguments.
        let none = json!({"type": "object", "properties": {}, "additionalProperties": false});
        assert_eq!(options[1]["properties"]["arguments"], none);
        // The name is written (and so generated) before the arguments.
        let text = grammar.lines().last().expect("last line");
        let name = text.find(r#""name":{"const":"now"}"#).expect("name");
        let arguments = text.rfind(r#""arguments":"#).expect("arguments");
        assert!(name < arguments, "{text}");
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
        assert_eq!(option["properties"]["parameters"]["properties"], weather.parameters["properties"]);
        assert_eq!(option["required"], json!(["name", "parameters"]));
    }

    #[test]
    fn arguments_are_the_declared_properties_unless_more_are_allowed() {
        let closed = json!({"type": "object", "properties": {}, "additionalProperties": false});
        assert_eq!(arguments_schema(&json!({})), closed);
        assert_eq!(arguments_schema(&Value::Null), closed);
        let open = json!({"type": "object", "additionalProperties": {"type": "integer"}});
        assert_eq!(arguments_schema(&open), open);
        let declared = json!({"properties": {"a": {"type": "string"}}});
        let expected =
            json!({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": false});
        assert_eq!(arguments_schema(&declared), expected);
    }
}
