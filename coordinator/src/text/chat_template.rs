//! Chat templates from `tokenizer_config.json`, rendered with minijinja the
//! way transformers' `apply_chat_template(tokenize=False)` renders them with
//! Jinja2: `trim_blocks` and `lstrip_blocks` on, loop controls, Python string
//! methods (`.strip()`, `.startswith()`, ...), Python's `None`/`True`/`False`
//! when printed, transformers' globals `raise_exception` and `strftime_now`,
//! and its `tojson`.
//!
//! OpenAI-style content lists (`[{"type": "text", "text": ...}]`) reach the
//! template as lists when it loops over a message's content (Gemma 3's,
//! GLM-4.5's, Mistral Small's), else joined into one string, as vLLM's
//! `--chat-template-content-format auto` decides; an assistant's tool-call
//! arguments (JSON text) become objects.

use minijinja::value::Value as JinjaValue;
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};

use super::jinja_compat;
use super::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The model ships no chat template (an HTTP 400: use completions).
    #[error("this model has no chat template (tokenizer_config.json has no chat_template)")]
    NoTemplate,
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    #[error("invalid message: {0}")]
    InvalidMessage(String),
    /// The template itself refused the conversation (`raise_exception`),
    /// e.g. roles that do not alternate.
    #[error("{0}")]
    Raised(String),
    #[error("chat template failed: {0}")]
    Render(String),
}

/// What `raise_exception(msg)` raises, told apart from other render errors.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

const NAME: &str = "chat_template";

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    content: ContentFormat,
}

/// How a message's content-part list reaches the template (vLLM's
/// `ChatTemplateContentFormat`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContentFormat {
    /// Text parts joined with newlines into one string.
    String,
    /// The list of parts as sent.
    OpenAi,
}

impl ContentFormat {
    /// vLLM's detection: parts stay a list when the template loops over a
    /// message's content (`for item in message['content']`, the message
    /// being a loop variable over `messages` or a variable set from it).
    pub fn detect(source: &str) -> Self {
        let tags: Vec<&str> = source
            .split("{%")
            .skip(1)
            .filter_map(|rest| rest.split_once("%}").map(|(tag, _)| tag.trim_matches(|c: char| c == '-' || c == '+')))
            .map(str::trim)
            .collect();
        let starts_with_name = |expr: &str, name: &str| {
            expr.strip_prefix(name)
                .is_some_and(|rest| rest.chars().next().is_none_or(|c| !(c.is_alphanumeric() || c == '_')))
        };
        // Names bound to the message list (`set loop_messages = messages[1:]`).
        let mut lists = vec!["messages".to_string()];
        for tag in &tags {
            if let Some((name, value)) = tag.strip_prefix("set ").and_then(|t| t.split_once('='))
                && lists.iter().any(|l| starts_with_name(value.trim(), l))
            {
                lists.push(name.trim().to_string());
            }
        }
        let loops: Vec<(&str, &str)> = tags
            .iter()
            .filter_map(|t| t.strip_prefix("for ")?.split_once(" in "))
            .map(|(target, iter)| (target.trim(), iter.trim()))
            .collect();
        let messages: Vec<&str> = loops
            .iter()
            .filter(|(_, iter)| lists.iter().any(|l| starts_with_name(iter, l)))
            .map(|(target, _)| target.rsplit(',').next().unwrap_or(target).trim())
            .collect();
        let over_content = |iter: &str| {
            messages.iter().any(|m| {
                iter.strip_prefix(m).is_some_and(|rest| {
                    rest.strip_prefix('.').is_some_and(|r| starts_with_name(r, "content"))
                        || rest.starts_with("['content']")
                        || rest.starts_with("[\"content\"]")
                })
            })
        };
        match loops.iter().any(|(_, iter)| over_content(iter)) {
            true => Self::OpenAi,
            false => Self::String,
        }
    }
}

/// Everything a request may set besides the messages.
#[derive(Default)]
pub struct RenderOptions<'a> {
    /// Ends the prompt with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// OpenAI `tools` (function definitions), as transformers' `tools=`.
    pub tools: Option<&'a [Value]>,
    /// Extra template variables (vLLM's `chat_template_kwargs`, e.g.
    /// `enable_thinking`); the standard ones above take precedence.
    pub extra: Option<&'a Map<String, Value>>,
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` fill the variables of the
    /// same names (an empty string when the model has none).
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(jinja_compat::python_formatter);
        env.add_filter("tojson", jinja_compat::tojson);
        env.add_function("tojson", jinja_compat::tojson);
        env.add_function("strftime_now", |format: String| jinja_compat::strftime_now(&format));
        env.add_function("raise_exception", |message: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
        });
        env.add_template_owned(NAME, source.to_string()).map_err(|e| TemplateError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.unwrap_or_default().to_string(),
            eos_token: eos_token.unwrap_or_default().to_string(),
            content: ContentFormat::detect(source),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The tokenizer's template; [`TemplateError::NoTemplate`] without one.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Self, TemplateError> {
        let source = tokenizer.chat_template().ok_or(TemplateError::NoTemplate)?;
        Self::new(source, tokenizer.bos_token(), tokenizer.eos_token())
    }

    /// As [`Self::for_tokenizer`], with a missing template as `None`.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>, TemplateError> {
        match Self::for_tokenizer(tokenizer) {
            Err(TemplateError::NoTemplate) => Ok(None),
            other => other.map(Some),
        }
    }

    /// The prompt text for `messages` (OpenAI chat format). Encode it without
    /// special tokens: the template writes BOS where the model wants it.
    pub fn render(&self, messages: &[Value], add_generation_prompt: bool) -> Result<String, TemplateError> {
        self.render_with(messages, &RenderOptions { add_generation_prompt, ..RenderOptions::default() })
    }

    pub fn render_with(&self, messages: &[Value], options: &RenderOptions<'_>) -> Result<String, TemplateError> {
        let messages = messages
            .iter()
            .enumerate()
            .map(|(i, m)| normalize_message(i, m, self.content))
            .collect::<Result<Vec<_>, _>>()?;
        let mut context = options.extra.cloned().unwrap_or_default();
        context.insert("messages".into(), Value::Array(messages));
        context.insert("add_generation_prompt".into(), Value::Bool(options.add_generation_prompt));
        context.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        context.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        if let Some(tools) = options.tools {
            context.insert("tools".into(), Value::Array(tools.to_vec()));
        }
        let template = self.env.get_template(NAME).map_err(|e| TemplateError::Render(describe(&e)))?;
        template.render(JinjaValue::from_serialize(&context)).map_err(|e| match raised_message(&e) {
            Some(message) => TemplateError::Raised(message),
            None => TemplateError::Render(describe(&e)),
        })
    }
}

/// Checks the shape templates rely on and flattens content-part lists
/// where the template takes strings.
fn normalize_message(index: usize, message: &Value, format: ContentFormat) -> Result<Value, TemplateError> {
    let invalid = |what: String| TemplateError::InvalidMessage(format!("messages[{index}]: {what}"));
    let Value::Object(fields) = message else { return Err(invalid("expected an object".into())) };
    if !fields.get("role").is_some_and(Value::is_string) {
        return Err(invalid("`role` must be a string".into()));
    }
    let mut fields = fields.clone();
    match fields.get("content") {
        None | Some(Value::String(_)) => {}
        // A call-only turn's `null` is empty text, as vLLM renders it:
        // templates that join content to strings cannot take `none`.
        Some(Value::Null) => {
            fields.insert("content".into(), Value::String(String::new()));
        }
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(text)) => texts.push(text),
                    (Some("text"), None) => return Err(invalid(format!("content[{j}] has no string `text`"))),
                    (Some(other), _) => {
                        return Err(invalid(format!("content[{j}] of type {other:?} is not supported (text only)")));
                    }
                    (None, _) => return Err(invalid(format!("content[{j}] has no `type`"))),
                }
            }
            if format == ContentFormat::String {
                fields.insert("content".into(), Value::String(texts.join("\n")));
            }
        }
        Some(_) => return Err(invalid("`content` must be a string, a list of parts, or null".into())),
    }
    if let Some(Value::Array(calls)) = fields.get_mut("tool_calls") {
        for (j, call) in calls.iter_mut().enumerate() {
            arguments_as_object(call).map_err(|e| invalid(format!("tool_calls[{j}].function.arguments: {e}")))?;
        }
    }
    Ok(Value::Object(fields))
}

/// A history call's `arguments`, which OpenAI sends as JSON text, parsed
/// into the object templates expect (`tool_call.arguments | tojson`), as
/// vLLM does; missing or empty arguments are `{}`.
fn arguments_as_object(call: &mut Value) -> Result<(), serde_json::Error> {
    let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) else { return Ok(()) };
    let parsed = match function.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(text)) if text.trim().is_empty() => Value::Object(Map::new()),
        Some(Value::String(text)) => serde_json::from_str(text)?,
        Some(_) => return Ok(()),
    };
    function.insert("arguments".into(), parsed);
    Ok(())
}

/// The message of a `raise_exception` anywhere in the error's chain.
fn raised_message(error: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(e) = source {
        if let Some(raised) = e.downcast_ref::<Raised>() {
            return Some(raised.0.clone());
        }
        source = e.source();
    }
    None
}

/// minijinja's message with its line number, without the template dump.
fn describe(error: &Error) -> String {
    match error.line() {
        Some(line) => format!("{} (line {line})", error.detail().unwrap_or(&error.to_string())),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    const TEST_DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests");

    fn read_json(path: &Path) -> Value {
        serde_json::from_str(&std::fs::read_to_string(path).expect("read")).expect("json")
    }

    fn qwen3() -> Tokenizer {
        Tokenizer::from_dir(&Path::new(TEST_DATA).join("models/tiny-qwen3")).expect("load tokenizer")
    }

    #[test]
    fn golden_chat_prompts_and_ids() {
        let tokenizer = qwen3();
        let template = ChatTemplate::for_tokenizer(&tokenizer).expect("template");
        let golden = read_json(&Path::new(TEST_DATA).join("golden/tiny-qwen3-chat.json"));
        let cases = golden["cases"].as_array().expect("cases");
        assert_eq!(cases.len(), 4);
        for case in cases {
            let name = &case["id"];
            let messages = case["messages"].as_array().expect("messages");
            let text = template.render(messages, true).expect("render");
            assert_eq!(text, case["prompt_text"].as_str().expect("prompt_text"), "{name}");
            let ids: Vec<u32> =
                case["prompt_ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect();
            assert_eq!(tokenizer.encode(&text, false).expect("encode"), ids, "{name}");
        }
    }

    /// Real-world templates (Qwen2.5 with tools, Llama 2 style without
    /// whitespace control, Llama 3.1 style), expected text from Jinja2 as
    /// transformers sets it up: see testdata/gen_chat_templates.py.
    #[test]
    fn matches_jinja2_on_real_templates() {
        let cases = read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/chat_templates.json"));
        for case in cases.as_array().expect("cases") {
            let name = &case["id"];
            let template = ChatTemplate::new(
                case["template"].as_str().expect("template"),
                case["bos_token"].as_str(),
                case["eos_token"].as_str(),
            )
            .expect("compile");
            let options = RenderOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().expect("flag"),
                tools: case["tools"].as_array().map(Vec::as_slice),
                extra: None,
            };
            let text = template.render_with(case["messages"].as_array().expect("messages"), &options);
            assert_eq!(text.expect("render"), case["expected"].as_str().expect("expected"), "{name}");
        }
    }

    /// The templates published with the newer families (Qwen3 and
    /// Qwen3-30B-A3B, gpt-oss, GLM-4.6 in GLM-4.5's format) render through
    /// our jinja as Jinja2 renders them, `chat_template_kwargs` included
    /// (`enable_thinking`, `reasoning_effort`); see
    /// testdata/gen_published_templates.py.
    #[test]
    fn matches_jinja2_on_published_templates() {
        let testdata = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata");
        let cases = read_json(&testdata.join("published_templates.json"));
        let today = crate::text::jinja_compat::strftime_now("%Y-%m-%d");
        for case in cases.as_array().expect("cases") {
            let name = &case["id"];
            let file = testdata.join("published").join(case["template_file"].as_str().expect("file"));
            let source = std::fs::read_to_string(&file).expect("template");
            let template = ChatTemplate::new(&source, case["bos_token"].as_str(), case["eos_token"].as_str())
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let options = RenderOptions {
                add_generation_prompt: case["add_generation_prompt"].as_bool().expect("flag"),
                tools: case["tools"].as_array().map(Vec::as_slice),
                extra: case["extra"].as_object(),
            };
            let text = template.render_with(case["messages"].as_array().expect("messages"), &options);
            let expected = case["expected"].as_str().expect("expected").replace("<today>", &today);
            assert_eq!(text.unwrap_or_else(|e| panic!("{name}: {e}")), expected, "{name}");
        }
    }

    /// vLLM's content-format detection on the published templates: those
    /// that loop over a message's content get the parts as a list.
    #[test]
    fn content_format_follows_the_template() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/published");
        let lists = ["gemma3.jinja", "glm-4.6.jinja", "mistral-small-3.2.jinja", "devstral-small.jinja"];
        for entry in std::fs::read_dir(&dir).expect("published templates") {
            let path = entry.expect("entry").path();
            let name = path.file_name().and_then(|n| n.to_str()).expect("name").to_string();
            let want = if lists.contains(&name.as_str()) { ContentFormat::OpenAi } else { ContentFormat::String };
            let source = std::fs::read_to_string(&path).expect("template");
            assert_eq!(ContentFormat::detect(&source), want, "{name}");
        }
        // A loop over something else called content is not a message's.
        let other = "{% for m in messages %}{% for c in m.contents %}{% endfor %}{% endfor %}";
        assert_eq!(ContentFormat::detect(other), ContentFormat::String);
        let macro_arg = "{% macro t(content) %}{% for i in content %}{% endfor %}{% endmacro %}";
        assert_eq!(ContentFormat::detect(macro_arg), ContentFormat::String);
        let indexed = "{%- for i, msg in messages -%}{%- for p in msg['content'] -%}{%- endfor -%}{%- endfor -%}";
        assert_eq!(ContentFormat::detect(indexed), ContentFormat::OpenAi);
    }

    /// Gemma 3's template refuses turns that do not alternate, by its own message.
    #[test]
    fn gemma3_refuses_roles_that_do_not_alternate() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/published");
        let source = std::fs::read_to_string(dir.join("gemma3.jinja")).expect("template");
        let template = ChatTemplate::new(&source, Some("<bos>"), Some("<eos>")).expect("compile");
        let twice = [json!({"role": "user", "content": "a"}), json!({"role": "user", "content": "b"})];
        match template.render(&twice, true) {
            Err(TemplateError::Raised(m)) => assert!(m.contains("must alternate"), "{m}"),
            other => panic!("expected the template's refusal, got {other:?}"),
        }
    }

    #[test]
    fn raise_exception_is_its_own_error() {
        let cases = read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src/text/testdata/chat_templates.json"));
        let llama2 = cases.as_array().and_then(|c| c.iter().find(|c| c["id"] == "llama2_style")).expect("case");
        let template = ChatTemplate::new(llama2["template"].as_str().expect("template"), Some("<s>"), Some("</s>"))
            .expect("compile");
        let err =
            template.render(&[json!({"role": "user", "content": "a"}), json!({"role": "user", "content": "b"})], false);
        match err {
            Err(TemplateError::Raised(message)) => {
                assert_eq!(message, "Conversation roles must alternate user/assistant/user/assistant/...")
            }
            other => panic!("expected Raised, got {other:?}"),
        }
    }

    #[test]
    fn content_parts_are_joined() {
        let template =
            ChatTemplate::new("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}", None, None)
                .expect("compile");
        let messages = [
            json!({"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}),
            json!({"role": "assistant", "content": null}),
            json!({"role": "user", "content": []}),
        ];
        assert_eq!(template.render(&messages, false).expect("render"), "[user:one\ntwo][assistant:][user:]");
        let image = json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        let err = template.render(&[image], false).expect_err("image part");
        assert!(
            matches!(&err, TemplateError::InvalidMessage(m) if m.contains("image_url") && m.contains("messages[0]")),
            "{err}"
        );
        for bad in [
            json!("hi"),
            json!({"content": "no role"}),
            json!({"role": "user", "content": 3}),
            json!({"role": "user", "content": [{"text": "x"}]}),
        ] {
            assert!(matches!(template.render(&[bad], false), Err(TemplateError::InvalidMessage(_))));
        }
    }

    #[test]
    fn tool_call_arguments_reach_templates_as_objects() {
        let template = ChatTemplate::new(
            "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments | tojson }}|{% endfor %}{% endfor %}",
            None,
            None,
        )
        .expect("compile");
        let call = |arguments: Value| json!({"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}});
        let message = json!({"role": "assistant", "content": null, "tool_calls": [
            call(json!("{\"city\": \"Zürich\"}")), call(json!("")), call(Value::Null), call(json!({"n": 1})),
        ]});
        assert_eq!(template.render(&[message], false).expect("render"), r#"{"city": "Zürich"}|{}|{}|{"n": 1}|"#);
        let bad = json!({"role": "assistant", "tool_calls": [call(json!("{oops"))]});
        let err = template.render(&[bad], false).expect_err("not JSON");
        assert!(
            matches!(&err, TemplateError::InvalidMessage(m) if m.contains("tool_calls[0].function.arguments")),
            "{err}"
        );
    }

    #[test]
    fn variables_and_python_methods() {
        let source = "{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages[0].content.strip().upper() }}|\
                      {{ messages[0].content.startswith('  hi') }}|{{ enable_thinking }}|{{ tools | length }}|{{ none }}";
        let template = ChatTemplate::new(source, Some("<s>"), None).expect("compile");
        let extra = json!({"enable_thinking": false, "bos_token": "ignored"});
        let tools = [json!({"type": "function"})];
        let options = RenderOptions { add_generation_prompt: true, tools: Some(&tools), extra: extra.as_object() };
        let text =
            template.render_with(&[json!({"role": "user", "content": "  hi there "})], &options).expect("render");
        assert_eq!(text, "<s>||True|HI THERE|True|False|1|None");
    }

    #[test]
    fn lstrip_and_trim_blocks_like_transformers() {
        let template = ChatTemplate::new(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n",
            None,
            None,
        )
        .expect("compile");
        let messages = [
            json!({"role": "user", "content": "a"}),
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": "b"}),
        ];
        assert_eq!(template.render(&messages, false).expect("render"), "a\nb\n");
    }

    #[test]
    fn missing_and_broken_templates() {
        let stories = Tokenizer::from_dir(&Path::new(TEST_DATA).join("models/stories260K")).expect("load");
        assert!(matches!(ChatTemplate::for_tokenizer(&stories), Err(TemplateError::NoTemplate)));
        assert!(ChatTemplate::from_tokenizer(&stories).expect("no error").is_none());
        assert!(ChatTemplate::from_tokenizer(&qwen3()).expect("compiles").is_some());
        assert!(matches!(ChatTemplate::new("{% for m in messages %}", None, None), Err(TemplateError::Syntax(_))));
        let template = ChatTemplate::new("{{ messages[0].content.nope() }}", None, None).expect("compile");
        assert!(matches!(
            template.render(&[json!({"role": "user", "content": "x"})], false),
            Err(TemplateError::Render(_))
        ));
    }
}
