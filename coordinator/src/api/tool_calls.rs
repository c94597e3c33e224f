//! Tool calling on `/v1/chat/completions`, as OpenAI and vLLM serve it:
//! `tools`, `tool_choice` and `parallel_tool_calls` read and checked (a
//! 400 naming the field otherwise), the history's tool calls and results
//! checked, and the model's calls turned into `message.tool_calls` or,
//! streaming, into `delta.tool_calls` (a call's id, type and name first,
//! then its arguments in fragments).
//!
//! `auto` parses whatever calls the model writes; `required` and a named
//! function also force them, with a grammar (`tool_parser::grammar`) the worker
//! applies to the tokens; `none` leaves the output as text. Tools reach the
//! chat template in every case, as vLLM passes them.

use common::{FinishReason, StructuredOutput};
use serde::Serialize;
use serde_json::Value;

use super::error::ApiError;
use crate::tool_parser::grammar::SpecialIds;
use crate::tool_parser::{Function, ToolCallParser, ToolEvent, ToolFormat, call_grammar, valid_name};

/// What the request asks of the model.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug)]
pub struct ToolRequest {
    /// The `tools` list as given, for the chat template.
    pub tools: Vec<Value>,
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    /// At most one call unless true (OpenAI's default).
    pub parallel: bool,
    /// `tool_choice` was given (not the default `auto`): errors about the
    /// choice name it rather than `tools`.
    explicit_choice: bool,
}

impl ToolRequest {
    /// The request's tool fields; `None` when it offers no tools.
    pub fn read(
        tools: Option<&[Value]>,
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        let choice = choice.filter(|c| !c.is_null());
        if tools.is_empty() {
            return match choice {
                Some(_) => Err(ApiError::invalid("tool_choice", "tool_choice is only allowed when tools are given")),
                None => Ok(None),
            };
        }
        let mut functions: Vec<Function> = Vec::with_capacity(tools.len());
        for (i, tool) in tools.iter().enumerate() {
            let function = read_tool(i, tool)?;
            if functions.iter().any(|f| f.name == function.name) {
                return Err(ApiError::invalid(
                    format!("tools[{i}].function.name"),
                    format!("two tools are named {:?}", function.name),
                ));
            }
            functions.push(function);
        }
        let explicit_choice = choice.is_some();
        let choice = match choice {
            None => ToolChoice::Auto,
            Some(choice) => read_choice(choice, &functions)?,
        };
        let parallel = parallel.unwrap_or(true);
        Ok(Some(Self { tools: tools.to_vec(), functions, choice, parallel, explicit_choice }))
    }

    /// The format the output's calls are read in: none for `tool_choice:
    /// "none"`; the model's (from its template or `--tool-call-parser`)
    /// otherwise, a 400 if it has none.
    pub fn format(&self, model_format: Option<ToolFormat>) -> Result<Option<ToolFormat>, ApiError> {
        if self.choice == ToolChoice::None {
            return Ok(None);
        }
        model_format.map(Some).ok_or_else(|| {
            ApiError::invalid(
                if self.explicit_choice { "tool_choice" } else { "tools" },
                "this model's chat template shows no tool-call format this server reads; start the coordinator \
                 with --tool-call-parser hermes or llama3_json, or send tool_choice \"none\"",
            )
        })
    }

    /// The grammar that forces the calls `required` or a named function asks for.
    /// `special` gives the id of a marker that is one special token.
    pub fn constraint(&self, format: ToolFormat, special: SpecialIds) -> Option<StructuredOutput> {
        let grammar = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required => {
                let all: Vec<&Function> = self.functions.iter().collect();
                call_grammar(format, &all, self.parallel, special)
            }
            ToolChoice::Named(name) => {
                let named: Vec<&Function> = self.functions.iter().filter(|f| &f.name == name).collect();
                call_grammar(format, &named, false, special)
            }
        };
        Some(StructuredOutput::Lark(grammar))
    }
}

/// `tools[i]`: `{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}`.
fn read_tool(i: usize, tool: &Value) -> Result<Function, ApiError> {
    let field = |name: &str| format!("tools[{i}]{name}");
    let Some(tool) = tool.as_object() else {
        return Err(ApiError::invalid(field(""), format!("{} must be an object", field(""))));
    };
    match tool.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(other) => {
            return Err(ApiError::invalid(field(".type"), format!("tool type must be \"function\", got {other}")));
        }
    }
    let Some(function) = tool.get("function").and_then(Value::as_object) else {
        return Err(ApiError::invalid(field(".function"), format!("{} must be an object", field(".function"))));
    };
    let name = match function.get("name") {
        Some(Value::String(name)) if valid_name(name) => name.clone(),
        Some(Value::String(name)) => {
            return Err(ApiError::invalid(
                field(".function.name"),
                format!("function names are 1 to 64 letters, digits, '_', '-', '.' or ':', got {name:?}"),
            ));
        }
        _ => {
            return Err(ApiError::invalid(field(".function.name"), format!("{} is required", field(".function.name"))));
        }
    };
    if function.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
        let param = field(".function.description");
        return Err(ApiError::invalid(param.clone(), format!("{param} must be a string")));
    }
    if function.get("strict").is_some_and(|s| !s.is_boolean() && !s.is_null()) {
        let param = field(".function.strict");
        return Err(ApiError::invalid(param.clone(), format!("{param} must be a boolean")));
    }
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => Value::Object(Default::default()),
        Some(schema) => {
            check_parameters(schema).map_err(|why| ApiError::invalid(field(".function.parameters"), why))?;
            schema.clone()
        }
    };
    Ok(Function { name, parameters })
}

/// A function's `parameters`: a JSON Schema for an object. What the grammar
/// compiler would trip on later is refused here by name.
fn check_parameters(schema: &Value) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        return Err(format!("parameters must be a JSON Schema object, got {schema}"));
    };
    match schema.get("type") {
        None => {}
        Some(Value::String(t)) if t == "object" => {}
        Some(other) => return Err(format!("parameters must describe an object (\"type\": \"object\"), got {other}")),
    }
    if let Some(properties) = schema.get("properties") {
        let Some(properties) = properties.as_object() else {
            return Err("parameters.properties must be an object".into());
        };
        if let Some((name, _)) = properties.iter().find(|(_, p)| !p.is_object() && !p.is_boolean()) {
            return Err(format!("parameters.properties.{name} must be a schema (an object)"));
        }
    }
    if let Some(required) = schema.get("required")
        && !required.as_array().is_some_and(|r| r.iter().all(Value::is_string))
    {
        return Err("parameters.required must be a list of property names".into());
    }
    Ok(())
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or
/// `{"type": "function", "function": {"name": ...}}` naming one of `functions`.
fn read_choice(choice: &Value, functions: &[Function]) -> Result<ToolChoice, ApiError> {
    let invalid = |why: String| Err(ApiError::invalid("tool_choice", why));
    match choice {
        Value::String(s) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            other => {
                invalid(format!("tool_choice must be \"none\", \"auto\", \"required\" or a function, got {other:?}"))
            }
        },
        Value::Object(object) => {
            let name = object.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let kind = object.get("type").and_then(Value::as_str);
            match (kind, name) {
                (Some("function") | None, Some(name)) if functions.iter().any(|f| f.name == name) => {
                    Ok(ToolChoice::Named(name.to_string()))
                }
                (Some("function") | None, Some(name)) => {
                    invalid(format!("tool_choice names the function {name:?}, which is not among the tools"))
                }
                _ => invalid(
                    "tool_choice as an object must be {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                ),
            }
        }
        _ => invalid(format!("tool_choice must be a string or an object, got {choice}")),
    }
}

/// The history's tool traffic: an assistant's `tool_calls` (each with a
/// function name, and arguments as JSON text or an object) and the `tool`
/// messages answering them (each with its `tool_call_id`).
pub fn check_messages(messages: &[Value]) -> Result<(), ApiError> {
    for (i, message) in messages.iter().enumerate() {
        let invalid = |why: String| Err(ApiError::invalid("messages", format!("messages[{i}]{why}")));
        match message.get("role").and_then(Value::as_str) {
            Some("tool") if !message.get("tool_call_id").is_some_and(Value::is_string) => {
                return invalid(".tool_call_id must be a string: the id of the call this answers".into());
            }
            Some("assistant") => {
                let calls = match message.get("tool_calls") {
                    None | Some(Value::Null) => continue,
                    Some(Value::Array(calls)) => calls,
                    Some(_) => return invalid(".tool_calls must be a list".into()),
                };
                for (j, call) in calls.iter().enumerate() {
                    let function = call.get("function");
                    if !function.and_then(|f| f.get("name")).is_some_and(Value::is_string) {
                        return invalid(format!(".tool_calls[{j}].function.name must be a string"));
                    }
                    let arguments = function.and_then(|f| f.get("arguments"));
                    if !matches!(arguments, None | Some(Value::Null | Value::String(_) | Value::Object(_))) {
                        return invalid(format!(".tool_calls[{j}].function.arguments must be a JSON string"));
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// OpenAI's `finish_reason`: `tool_calls` when the model called a tool
/// and ended by itself (a call cut by `max_tokens` stays `length`).
pub fn finish_reason(called: bool, reason: FinishReason) -> &'static str {
    if called && reason == FinishReason::Stop { "tool_calls" } else { reason.as_str() }
}

/// A finished call, as in `message.tool_calls`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text, as the model wrote it.
    pub arguments: String,
}

/// A piece of a call in a stream's `delta.tool_calls`: the first carries
/// its id, type and name; the rest, pieces of its arguments.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// One choice's output read for calls as it streams.
pub struct ChoiceTools {
    parser: ToolCallParser,
    parallel: bool,
    /// Unique per choice; call ids are `call_<this>_<index>`.
    id_base: String,
}

/// What a piece of output shows: text for `content`, and call pieces.
#[derive(Debug, Default, PartialEq)]
pub struct ToolDelta {
    pub content: String,
    pub calls: Vec<ToolCallDelta>,
}

impl ChoiceTools {
    /// `functions` (the request's tools) type Qwen3-Coder's parameters.
    pub fn new(format: ToolFormat, functions: &[Function], parallel: bool, id_base: String) -> Self {
        Self { parser: ToolCallParser::new(format, functions), parallel, id_base }
    }

    pub fn push(&mut self, text: &str) -> ToolDelta {
        let events = self.parser.push(text);
        self.deltas(events)
    }

    pub fn finish(&mut self) -> ToolDelta {
        let events = self.parser.finish();
        self.deltas(events)
    }

    /// Whether the model called a tool (its `finish_reason` is then `tool_calls`).
    pub fn called(&self) -> bool {
        self.parser.calls() > 0
    }

    fn deltas(&self, events: Vec<ToolEvent>) -> ToolDelta {
        let mut out = ToolDelta::default();
        for event in events {
            match event {
                ToolEvent::Content(text) => out.content.push_str(&text),
                // Without parallel calls, only the first one counts.
                ToolEvent::CallStart { index, .. } | ToolEvent::Arguments { index, .. }
                    if index > 0 && !self.parallel => {}
                ToolEvent::CallStart { index, name } => out.calls.push(ToolCallDelta {
                    index,
                    id: Some(format!("call_{}_{index}", self.id_base)),
                    kind: Some("function"),
                    function: FunctionDelta { name: Some(name), arguments: String::new() },
                }),
                // A call's start stays apart (empty arguments), as OpenAI streams it.
                ToolEvent::Arguments { index, fragment } => match out.calls.last_mut() {
                    Some(last) if last.index == index && last.id.is_none() => {
                        last.function.arguments.push_str(&fragment)
                    }
                    _ => out.calls.push(ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionDelta { name: None, arguments: fragment },
                    }),
                },
            }
        }
        out
    }

    /// The last piece of output, then the end: everything still held.
    pub fn finish_after(&mut self, text: &str) -> ToolDelta {
        let mut delta = self.push(text);
        let rest = self.finish();
        delta.content.push_str(&rest.content);
        delta.calls.extend(rest.calls);
        delta
    }

    /// A whole output's content (`None` if there is none) and calls.
    pub fn whole(mut self, text: &str) -> (Option<String>, Vec<ToolCall>) {
        let delta = self.finish_after(text);
        let mut calls: Vec<ToolCall> = Vec::new();
        for piece in delta.calls {
            match (piece.id, piece.function.name) {
                (Some(id), Some(name)) => calls.push(ToolCall {
                    id,
                    kind: "function",
                    function: FunctionCall { name, arguments: piece.function.arguments },
                }),
                _ => {
                    if let Some(call) = calls.get_mut(piece.index) {
                        call.function.arguments.push_str(&piece.function.arguments);
                    }
                }
            }
        }
        ((!delta.content.is_empty()).then_some(delta.content), calls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather_tool() -> Value {
        json!({"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }})
    }

    fn read(tools: Value, choice: Option<Value>) -> Result<Option<ToolRequest>, ApiError> {
        ToolRequest::read(tools.as_array().map(Vec::as_slice), choice.as_ref(), None)
    }

    #[test]
    fn tool_fields_are_read() {
        let tools = json!([weather_tool(), {"function": {"name": "now"}}]);
        let request = read(tools.clone(), None).unwrap().unwrap();
        assert_eq!(request.choice, ToolChoice::Auto);
        assert!(request.parallel);
        assert_eq!(request.tools.len(), 2);
        assert_eq!(request.functions[1], Function { name: "now".into(), parameters: json!({}) });
        for (choice, expected) in [
            (json!("none"), ToolChoice::None),
            (json!("required"), ToolChoice::Required),
            (json!({"type": "function", "function": {"name": "now"}}), ToolChoice::Named("now".into())),
        ] {
            assert_eq!(read(tools.clone(), Some(choice)).unwrap().unwrap().choice, expected);
        }
        assert!(read(json!([]), None).unwrap().is_none());
        assert!(read(Value::Null, Some(Value::Null)).unwrap().is_none());
        let single = ToolRequest::read(tools.as_array().map(Vec::as_slice), None, Some(false)).unwrap().unwrap();
        assert!(!single.parallel);
    }

    #[test]
    fn bad_tool_fields_are_named() {
        let ok = weather_tool();
        for (tools, choice, param, words) in [
            (json!([ok]), Some(json!({"type": "function", "function": {"name": "nope"}})), "tool_choice", "nope"),
            (json!([ok]), Some(json!("sometimes")), "tool_choice", "required"),
            (json!([ok]), Some(json!(3)), "tool_choice", "string or an object"),
            (json!([ok]), Some(json!({"type": "function"})), "tool_choice", "name"),
            (json!([]), Some(json!("required")), "tool_choice", "only allowed"),
            (Value::Null, Some(json!("auto")), "tool_choice", "only allowed"),
            (json!(["f"]), None, "tools[0]", "object"),
            (json!([{"type": "code_interpreter"}]), None, "tools[0].type", "function"),
            (json!([{"type": "function"}]), None, "tools[0].function", "object"),
            (json!([{"function": {"description": "x"}}]), None, "tools[0].function.name", "required"),
            (json!([{"function": {"name": "a b"}}]), None, "tools[0].function.name", "letters"),
            (json!([ok, {"function": {"name": "get_weather"}}]), None, "tools[1].function.name", "two tools"),
            (json!([{"function": {"name": "f", "parameters": "{}"}}]), None, "tools[0].function.parameters", "Schema"),
            (
                json!([{"function": {"name": "f", "parameters": {"type": "array"}}}]),
                None,
                "tools[0].function.parameters",
                "object",
            ),
            (
                json!([{"function": {"name": "f", "parameters": {"properties": {"a": 1}}}}]),
                None,
                "tools[0].function.parameters",
                "properties.a",
            ),
            (
                json!([{"function": {"name": "f", "parameters": {"required": "a"}}}]),
                None,
                "tools[0].function.parameters",
                "required",
            ),
            (json!([{"function": {"name": "f", "strict": "yes"}}]), None, "tools[0].function.strict", "boolean"),
        ] {
            let err = read(tools.clone(), choice.clone()).unwrap_err();
            assert_eq!(err.status, hyper::StatusCode::BAD_REQUEST);
            assert_eq!(err.param.as_deref(), Some(param), "{tools} {choice:?}: {err:?}");
            assert!(err.message.contains(words), "{tools} {choice:?}: {}", err.message);
        }
    }

    #[test]
    fn a_format_is_needed_unless_the_choice_is_none() {
        let tools = json!([weather_tool()]);
        let auto = read(tools.clone(), None).unwrap().unwrap();
        assert_eq!(auto.format(Some(ToolFormat::Hermes)).unwrap(), Some(ToolFormat::Hermes));
        assert_eq!(auto.format(None).unwrap_err().param.as_deref(), Some("tools"));
        let explicit = read(tools.clone(), Some(json!("auto"))).unwrap().unwrap();
        assert_eq!(explicit.format(None).unwrap_err().param.as_deref(), Some("tool_choice"));
        assert!(auto.constraint(ToolFormat::Hermes, &|_| None).is_none());
        let none = read(tools.clone(), Some(json!("none"))).unwrap().unwrap();
        assert_eq!(none.format(None).unwrap(), None);
    }

    #[test]
    fn required_and_named_choices_are_forced_by_a_grammar() {
        let tools = json!([weather_tool(), {"function": {"name": "now"}}]);
        let lark = |choice: Value, parallel: bool| {
            let request =
                ToolRequest::read(tools.as_array().map(Vec::as_slice), Some(&choice), Some(parallel)).unwrap().unwrap();
            match request.constraint(ToolFormat::Hermes, &|_| None) {
                Some(StructuredOutput::Lark(grammar)) => grammar,
                other => panic!("{other:?}"),
            }
        };
        let required = lark(json!("required"), true);
        assert!(required.contains("start: call (\"\\n\" call)*") && required.contains("\"const\":\"now\""));
        assert!(required.contains("\"const\":\"get_weather\""), "{required}");
        let named = lark(json!({"type": "function", "function": {"name": "now"}}), true);
        assert!(named.contains("start: call\n") && !named.contains("get_weather"), "{named}");
    }

    #[test]
    fn history_with_calls_and_results() {
        let call = json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}});
        let good = [
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": null, "tool_calls": [call]}),
            json!({"role": "tool", "tool_call_id": "call_1", "content": "42"}),
        ];
        check_messages(&good).unwrap();
        for (bad, words) in [
            (json!({"role": "tool", "content": "42"}), "messages[0].tool_call_id"),
            (json!({"role": "assistant", "tool_calls": {}}), "list"),
            (
                json!({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}),
                "tool_calls[0].function.name",
            ),
            (json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}), "arguments"),
        ] {
            let err = check_messages(std::slice::from_ref(&bad)).unwrap_err();
            assert_eq!(err.param.as_deref(), Some("messages"));
            assert!(err.message.contains(words), "{bad}: {}", err.message);
        }
    }

    #[test]
    fn calls_become_openai_deltas_and_messages() {
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n\
                    </tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
        let mut stream = ChoiceTools::new(ToolFormat::Hermes, &[], true, "7".into());
        let mut deltas = Vec::new();
        for piece in [&text[..20], &text[20..60], &text[60..]] {
            deltas.push(stream.push(piece));
        }
        deltas.push(stream.finish());
        assert!(stream.called());
        let content: String = deltas.iter().map(|d| d.content.as_str()).collect();
        assert_eq!(content, "Checking.");
        let calls: Vec<&ToolCallDelta> = deltas.iter().flat_map(|d| &d.calls).collect();
        assert_eq!(calls[0].id.as_deref(), Some("call_7_0"));
        assert_eq!((calls[0].kind, calls[0].function.name.as_deref()), (Some("function"), Some("get_weather")));
        assert!(calls[1..].iter().all(|c| c.index == 1 || (c.id.is_none() && c.function.name.is_none())));
        let wire = serde_json::to_value(calls[0]).unwrap();
        assert_eq!(wire["function"]["name"], "get_weather");
        assert!(wire["function"]["arguments"].is_string());

        let (content, calls) = ChoiceTools::new(ToolFormat::Hermes, &[], true, "7".into()).whole(text);
        assert_eq!(content.as_deref(), Some("Checking."));
        assert_eq!(calls.len(), 2);
        assert_eq!(
            calls[0].function,
            FunctionCall { name: "get_weather".into(), arguments: r#"{"city": "Paris"}"#.into() }
        );
        assert_eq!((calls[1].id.as_str(), calls[1].function.arguments.as_str()), ("call_7_1", "{}"));
        let streamed: String = deltas
            .iter()
            .flat_map(|d| &d.calls)
            .filter(|c| c.index == 0)
            .map(|c| c.function.arguments.as_str())
            .collect();
        assert_eq!(streamed, calls[0].function.arguments);

        // Without parallel calls only the first counts; without calls, all is content.
        let (_, calls) = ChoiceTools::new(ToolFormat::Hermes, &[], false, "8".into()).whole(text);
        assert_eq!(calls.len(), 1);
        let plain = ChoiceTools::new(ToolFormat::Hermes, &[], true, "9".into());
        assert_eq!(plain.whole("just words "), (Some("just words ".to_string()), vec![]));
        let empty = ChoiceTools::new(ToolFormat::Hermes, &[], true, "9".into());
        assert_eq!(empty.whole(""), (None, vec![]));
    }
}
