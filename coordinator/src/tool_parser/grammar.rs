//! The grammar that forces tool calls, for `tool_choice: "required"` or a
//! named function: llguidance's Lark dialect (`common::StructuredOutput::Lark`),
//! with JSON given as inline `%json` schemas. The calls are written in the
//! model's own format, so the parser that reads unforced calls reads these
//! too:
//!
//! * Hermes: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`,
//!   calls joined by `\n`;
//! * Llama 3 JSON: `{"name": "f", "parameters": {...}}`, calls joined by `; `;
//! * Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`, or
//!   `[TOOL_CALLS]f[ARGS]{...}` per call where the template writes `[ARGS]`;
//! * Qwen3-Coder: `<tool_call>\n<function=f>\n<parameter=p>\nVALUE\n</parameter>\n
//!   </function>\n</tool_call>`, a string's value free text, any other
//!   value JSON of the parameter's schema; required parameters always,
//!   the others optional, in the schema's order;
//! * Harmony (gpt-oss): an optional `analysis` message, then one message
//!   `<|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}`
//!   (gpt-oss calls one tool per turn: `<|call|>` ends generation).
//!
//! A marker that is one special token of the model's vocabulary
//! (`[TOOL_CALLS]`, `<|channel|>`) is written as that token (`<[id]>`),
//! not as the characters that spell it, which the model never writes.
//!
//! Each JSON call's schema is `{"name": {"const": f}, <key>: f's
//! parameters}` for every offered `f` (an `anyOf`), so the name is one of
//! the tools and the arguments validate against that tool's schema (closed
//! to other keys unless it allows them: see `arguments_schema`). JSON is
//! written with `", "` and `": "` between items and no other whitespace,
//! as the models' own examples are: a model left free to add whitespace
//! can wander off into it (llguidance's default allows any).

use serde_json::{Value, json};

use super::{Function, MistralCalls, ToolFormat};
use crate::reasoning::ReasoningFormat;
use crate::reasoning::grammar::{marker, thinking_rules};

pub use crate::reasoning::grammar::SpecialIds;

/// The Lark grammar of one call (`parallel` false) or one or more calls to
/// `functions` (at least one), in `format`.
pub fn call_grammar(format: ToolFormat, functions: &[&Function], parallel: bool, special: SpecialIds) -> String {
    let marker = |text: &str| marker(special, text);
    let repeat = |separator: &str| {
        if parallel { format!("call ({separator} call)*") } else { "call".to_string() }
    };
    let header = "%llguidance {}\n\n";
    match format {
        ToolFormat::Hermes => format!(
            "{header}start: {}\ncall: \"<tool_call>\\n\" call_json \"\\n</tool_call>\"\ncall_json: %json {}\n",
            repeat(r#""\n""#),
            call_schema(functions, "arguments")
        ),
        ToolFormat::Llama3Json => format!(
            "{header}start: {}\ncall: call_json\ncall_json: %json {}\n",
            repeat(r#""; ""#),
            call_schema(functions, "parameters")
        ),
        ToolFormat::Mistral(MistralCalls::List) => format!(
            "{header}start: {} \"[\" {} \"]\"\ncall: call_json\ncall_json: %json {}\n",
            marker("[TOOL_CALLS]"),
            repeat(r#"", ""#),
            call_schema(functions, "arguments")
        ),
        ToolFormat::Mistral(MistralCalls::Args) => {
            let mut grammar = format!("{header}start: {}\n", if parallel { "call+" } else { "call" });
            let (calls, args) = (marker("[TOOL_CALLS]"), marker("[ARGS]"));
            let options: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
            grammar.push_str(&format!("call: {}\n", options.join(" | ")));
            for (i, f) in functions.iter().enumerate() {
                grammar.push_str(&format!("call_{i}: {calls} {} {args} args_{i}\n", json!(f.name)));
                grammar.push_str(&format!("args_{i}: %json {}\n", compact(arguments_schema(&f.parameters))));
            }
            grammar
        }
        ToolFormat::Qwen3Coder => qwen3_coder_grammar(functions, parallel),
        ToolFormat::Harmony => {
            let [channel, message, constrain] = ["<|channel|>", "<|message|>", "<|constrain|>"].map(marker);
            let mut grammar = format!("{header}start: reasoning? call\n");
            grammar.push_str(&thinking_rules(ReasoningFormat::GptOss, special));
            let options: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
            grammar.push_str(&format!("call: {channel} \"commentary to=functions.\" ({})\n", options.join(" | ")));
            for (i, f) in functions.iter().enumerate() {
                let name = json!(format!("{} ", f.name));
                grammar.push_str(&format!("call_{i}: {name} {constrain} \"json\" {message} args_{i}\n"));
                grammar.push_str(&format!("args_{i}: %json {}\n", compact(arguments_schema(&f.parameters))));
            }
            grammar
        }
    }
}

/// Qwen3-Coder's calls (see the module comment).
fn qwen3_coder_grammar(functions: &[&Function], parallel: bool) -> String {
    let start = if parallel { r#"call ("\n" call)*"# } else { "call" };
    let mut grammar = format!("%llguidance {{}}\n\nstart: {start}\n");
    let options: Vec<String> = (0..functions.len()).map(|i| format!("fn_{i}")).collect();
    grammar.push_str(&format!("call: \"<tool_call>\\n\" ({}) \"</tool_call>\"\n", options.join(" | ")));
    for (i, f) in functions.iter().enumerate() {
        let properties = f.parameters.get("properties").and_then(Value::as_object);
        let required: Vec<&str> = f
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let mut body = vec![json!(format!("<function={}>\n", f.name)).to_string()];
        for (j, (name, schema)) in properties.into_iter().flatten().enumerate() {
            let optional = if required.contains(&name.as_str()) { "" } else { "?" };
            body.push(format!("p_{i}_{j}{optional}"));
            let open = json!(format!("<parameter={name}>\n"));
            let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
            let choices: Option<Vec<String>> = schema
                .get("enum")
                .and_then(Value::as_array)
                .and_then(|e| e.iter().map(|v| v.as_str().map(|s| json!(s).to_string())).collect());
            if let Some(choices) = choices.filter(|c| is_string && !c.is_empty()) {
                // One of the strings, written as text like any string.
                grammar.push_str(&format!("p_{i}_{j}: {open} ({}) \"\\n</parameter>\\n\"\n", choices.join(" | ")));
            } else if is_string {
                // Free text that stops at the closing tag's first appearance.
                grammar.push_str(&format!("p_{i}_{j}: {open} v_{i}_{j}\n"));
                grammar.push_str(&format!("v_{i}_{j}[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/\n"));
            } else {
                grammar.push_str(&format!("p_{i}_{j}: {open} v_{i}_{j} \"\\n</parameter>\\n\"\n"));
                grammar.push_str(&format!("v_{i}_{j}: %json {}\n", compact(schema.clone())));
            }
        }
        body.push(r#""</function>\n""#.to_string());
        grammar.push_str(&format!("fn_{i}: {}\n", body.join(" ")));
    }
    grammar
}

/// A schema as compact JSON text, laid out as the calls' JSON is.
fn compact(schema: Value) -> String {
    let mut schema = schema;
    if let Value::Object(map) = &mut schema {
        map.insert("x-guidance".into(), layout());
    }
    schema.to_string()
}

fn layout() -> Value {
    json!({ "whitespace_flexible": false, "item_separator": ", ", "key_separator": ": " })
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
    format!(r#"{{"x-guidance":{},"anyOf":[{}]}}"#, layout(), options.join(","))
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
        let grammar = call_grammar(ToolFormat::Hermes, &[&weather, &now], false, &|_| None);
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
        let hermes = call_grammar(ToolFormat::Hermes, &[&weather], true, &|_| None);
        assert!(hermes.contains("\nstart: call (\"\\n\" call)*\n"), "{hermes}");
        let llama = call_grammar(ToolFormat::Llama3Json, &[&weather], true, &|_| None);
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

    /// A vocabulary of single bytes, the given markers as special tokens,
    /// and EOS; the ids of the markers.
    fn vocabulary(specials: &[&str]) -> (common::structured::GrammarCompiler, Vec<(String, u32)>, u32) {
        let mut tokens: Vec<Vec<u8>> = (0u8..=255).map(|b| vec![b]).collect();
        let mut ids = Vec::new();
        for marker in specials {
            ids.push((marker.to_string(), tokens.len() as u32));
            tokens.push([b"\xFF".as_slice(), marker.as_bytes()].concat());
        }
        tokens.push(b"\xFF</s>".to_vec());
        let eos = tokens.len() as u32 - 1;
        let size = tokens.len();
        (common::structured::GrammarCompiler::from_token_bytes(tokens, size, &[eos]).expect("vocabulary"), ids, eos)
    }

    /// Whether the grammar of a required call to `functions` accepts `text`
    /// whole (then EOS), the markers in `specials` being one token each.
    fn accepts(format: ToolFormat, functions: &[&Function], specials: &[&str], text: &str) -> bool {
        let (compiler, ids, eos) = vocabulary(specials);
        let special = |marker: &str| ids.iter().find(|(m, _)| m == marker).map(|(_, id)| *id);
        let grammar = call_grammar(format, functions, true, &special);
        let mut matcher = compiler
            .compile(&common::StructuredOutput::Lark(grammar.clone()))
            .unwrap_or_else(|e| panic!("{format} grammar does not compile: {e}\n{grammar}"));
        let mut tokens = Vec::new();
        let mut pos = 0;
        while pos < text.len() {
            let special = text
                .is_char_boundary(pos)
                .then(|| ids.iter().find(|(m, _)| text[pos..].starts_with(m.as_str())))
                .flatten();
            match special {
                Some((m, id)) => {
                    tokens.push(*id);
                    pos += m.len();
                }
                None => {
                    tokens.push(text.as_bytes()[pos] as u32);
                    pos += 1;
                }
            }
        }
        for token in tokens {
            let mask = matcher.compute_mask_or_eos().expect("mask");
            if !mask.is_allowed(token) || matcher.consume_tokens(&[token]).is_err() {
                return false;
            }
        }
        matcher.compute_mask_or_eos().expect("mask").is_allowed(eos)
    }

    /// Each format's grammar compiles and accepts a call its parser reads
    /// back as that call; with its markers as special tokens and without.
    #[test]
    fn every_formats_grammar_writes_calls_its_parser_reads() {
        let (weather, now) = (weather(), now());
        let functions = [&weather, &now];
        let owned: Vec<Function> = functions.iter().map(|f| (*f).clone()).collect();
        let markers = ["[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>"];
        let harmony_call =
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        let cases = [
            (ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>".to_string()),
            (ToolFormat::Llama3Json, "{\"name\": \"now\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}".to_string()),
            (ToolFormat::Mistral(MistralCalls::List), "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]".to_string()),
            (ToolFormat::Mistral(MistralCalls::Args), "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[ARGS]{}".to_string()),
            (ToolFormat::Qwen3Coder, "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão <b> Paulo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>".to_string()),
            (ToolFormat::Harmony, harmony_call.to_string()),
            (ToolFormat::Harmony, format!("<|channel|>analysis<|message|>Weather, so.<|end|><|start|>assistant{harmony_call}")),
        ];
        for (format, text) in &cases {
            for specials in [&markers[..], &[]] {
                assert!(accepts(*format, &functions, specials, text), "{format} ({} specials): {text}", specials.len());
            }
            let calls: Vec<String> = crate::tool_parser::ToolCallParser::parse(*format, &owned, text)
                .into_iter()
                .filter_map(|e| match e {
                    crate::tool_parser::ToolEvent::CallStart { name, .. } => Some(name),
                    _ => None,
                })
                .collect();
            assert!(calls.first().is_some_and(|n| n == "get_weather" || n == "now"), "{format}: {calls:?}");
        }
        // What the grammars refuse: a tool not offered, a required parameter left out.
        let refused = [
            (ToolFormat::Mistral(MistralCalls::Args), "[TOOL_CALLS]other[ARGS]{}"),
            (
                ToolFormat::Qwen3Coder,
                "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
            ),
            (ToolFormat::Harmony, "<|channel|>final<|message|>No call."),
        ];
        // Qwen3-Coder writes a string from an enum as text, not as JSON.
        let pick = Function {
            name: "pick".into(),
            parameters: json!({"type": "object", "properties": {"c": {"type": "string", "enum": ["a b", "c"]}}, "required": ["c"]}),
        };
        let text = "<tool_call>\n<function=pick>\n<parameter=c>\na b\n</parameter>\n</function>\n</tool_call>";
        assert!(accepts(ToolFormat::Qwen3Coder, &[&pick], &[], text));
        assert!(!accepts(ToolFormat::Qwen3Coder, &[&pick], &[], &text.replace("a b", "\"a b\"")));
        for (format, text) in refused {
            assert!(!accepts(format, &functions, &markers, text), "{format} accepted {text}");
        }
    }
}
