//! Logging through `tracing`: every binary calls [`init`] once, and code
//! logs with `tracing::info!`, `warn!`, `error!` and `debug!`, in spans
//! that carry request and worker ids (`request{id=5}`), so one request can
//! be followed across the coordinator's and the workers' logs.
//!
//! `RUST_LOG` filters as everywhere in Rust (`RUST_LOG=debug`,
//! `RUST_LOG=info,coordinator::cluster=debug`); the default is `info`.
//! Two formats, one event a line on stderr:
//! * `human` (the default): a UTC timestamp (RFC 3339, milliseconds), the
//!   process's name, a `warning:`/`error:`/`debug:` tag for those levels,
//!   the message, then the event's fields and its spans' fields, e.g.
//!   `2026-11-26T07:40:01.123Z worker mac-mini-1: registered with 10.0.0.2:7070`;
//! * `json` (`--log-format json`), for log shippers: one object a line
//!   with `timestamp`, `level`, `process`, `target`, `message`, `fields`
//!   and `spans` (outermost first, each with its `name` and fields).
//!
//! Several workers' logs end up interleaved in one terminal, journal or
//! file, so every line says when and who. The name is set once
//! ([`set_process_name`]); lines before that carry the binary's name.

use std::fmt;
use std::sync::OnceLock;

use serde_json::{Map, Value};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry};

static PROCESS_NAME: OnceLock<String> = OnceLock::new();
static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// How log lines are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// `TIMESTAMP PROCESS: message fields (spans)`.
    #[default]
    Human,
    /// One JSON object a line.
    Json,
}

impl LogFormat {
    pub fn name(self) -> &'static str {
        match self {
            Self::Human => "human",
            Self::Json => "json",
        }
    }
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "human" => Ok(Self::Human),
            "json" => Ok(Self::Json),
            other => Err(format!("log format {other:?} is not human or json")),
        }
    }
}

/// The environment variable a child process reads its log format from
/// (the coordinator sets it for the workers it starts).
pub const FORMAT_ENV: &str = "TINYVLLM_LOG_FORMAT";

/// Installs the process's logger: `format` lines on stderr, filtered by
/// `RUST_LOG` (default `info`). A second call changes nothing.
pub fn init(format: LogFormat) {
    let _ = FORMAT.set(format);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let layer = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(false);
    let _ = match format {
        LogFormat::Human => Registry::default().with(filter).with(layer.event_format(Lines(format))).try_init(),
        LogFormat::Json => Registry::default()
            .with(filter)
            .with(layer.fmt_fields(JsonFields::new()).event_format(Lines(format)))
            .try_init(),
    };
}

/// The format [`init`] installed (human before it ran).
pub fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

/// Names this process in every later line (first call wins).
pub fn set_process_name(name: impl Into<String>) {
    let _ = PROCESS_NAME.set(name.into());
}

/// The name lines carry: the one set, else the executable's short name.
pub fn process_name() -> &'static str {
    PROCESS_NAME.get_or_init(|| {
        let exe = std::env::args().next().unwrap_or_default();
        let base = exe.rsplit('/').next().unwrap_or_default();
        base.strip_prefix("tinyvllm-").unwrap_or(base).to_string()
    })
}

/// `2026-11-26T07:40:01.123Z`: now, in UTC.
pub fn timestamp() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string()
}

/// The event formatter of both formats.
struct Lines(LogFormat);

impl<S, N> FormatEvent<S, N> for Lines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        // Each enclosing span's name and its fields as the field formatter
        // rendered them (`id=5` for human lines, `{"id":5}` for JSON).
        let spans: Vec<(&'static str, String)> = ctx
            .event_scope()
            .into_iter()
            .flat_map(|scope| scope.from_root())
            .map(|span| {
                let rendered = span.extensions().get::<FormattedFields<N>>().map(|f| f.fields.clone());
                (span.name(), rendered.unwrap_or_default())
            })
            .collect();
        let meta = event.metadata();
        let line = match self.0 {
            LogFormat::Human => human_line(*meta.level(), &fields, &spans),
            LogFormat::Json => json_line(*meta.level(), meta.target(), fields, &spans),
        };
        writeln!(writer, "{line}")
    }
}

/// An event's message and its other fields, in order.
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(&'static str, Value)>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.record(field, Value::from(value));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record(field, Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.record(field, Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.record(field, Value::from(value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.record(field, Value::from(format!("{value:?}")));
    }
}

impl Fields {
    fn record(&mut self, field: &Field, value: Value) {
        if field.name() == "message" {
            self.message = match value {
                Value::String(s) => s,
                other => other.to_string(),
            };
        } else {
            self.others.push((field.name(), value));
        }
    }
}

fn human_line(level: Level, fields: &Fields, spans: &[(&'static str, String)]) -> String {
    let tag = match level {
        Level::ERROR => "error: ",
        Level::WARN => "warning: ",
        Level::DEBUG => "debug: ",
        Level::TRACE => "trace: ",
        Level::INFO => "",
    };
    let mut line = format!("{} {}: {tag}{}", timestamp(), process_name(), fields.message);
    for (name, value) in &fields.others {
        match value {
            Value::String(s) => line += &format!(" {name}={s}"),
            other => line += &format!(" {name}={other}"),
        }
    }
    if !spans.is_empty() {
        let shown: Vec<String> = spans
            .iter()
            .map(|(name, f)| if f.is_empty() { name.to_string() } else { format!("{name}{{{f}}}") })
            .collect();
        line += &format!(" ({})", shown.join(" "));
    }
    line
}

fn json_line(level: Level, target: &str, fields: Fields, spans: &[(&'static str, String)]) -> String {
    let spans: Vec<Value> = spans
        .iter()
        .map(|(name, rendered)| {
            let mut span = match serde_json::from_str::<Value>(rendered) {
                Ok(Value::Object(map)) => map,
                _ => Map::new(),
            };
            span.insert("name".into(), Value::from(*name));
            Value::Object(span)
        })
        .collect();
    let line = serde_json::json!({
        "timestamp": timestamp(),
        "level": level.as_str(),
        "process": process_name(),
        "target": target,
        "message": fields.message,
        "fields": fields.others.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<String, Value>>(),
        "spans": spans,
    });
    line.to_string()
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// What a subscriber of `format` writes while `f` logs.
    fn captured(format: LogFormat, f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0.lock().expect("buffer").extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let layer = tracing_subscriber::fmt::layer().with_ansi(false).with_writer(move || writer.clone());
        let filter = EnvFilter::new("debug");
        match format {
            LogFormat::Human => tracing::subscriber::with_default(
                Registry::default().with(filter).with(layer.event_format(Lines(format))),
                f,
            ),
            LogFormat::Json => tracing::subscriber::with_default(
                Registry::default().with(filter).with(layer.fmt_fields(JsonFields::new()).event_format(Lines(format))),
                f,
            ),
        }
        String::from_utf8(buffer.0.lock().expect("buffer").clone()).expect("utf-8")
    }

    fn log_a_request() {
        tracing::info!("registered as {}", 3);
        let span = tracing::info_span!("request", id = 5u64, worker = "mac-2");
        let _entered = span.enter();
        tracing::warn!(tokens = 7u64, "moved to another worker");
        tracing::trace!("not shown at debug");
    }

    #[test]
    fn human_lines_carry_time_process_level_fields_and_spans() {
        let out = captured(LogFormat::Human, log_a_request);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        let (time, rest) = lines[0].split_once(' ').expect("a timestamp first");
        assert!(
            chrono::DateTime::parse_from_rfc3339(time).is_ok() && time.ends_with('Z') && time.len() == 24,
            "{time}"
        );
        assert!(rest.ends_with(": registered as 3"), "{rest}");
        assert!(!rest.contains('('), "no span outside one: {rest}");
        assert!(
            lines[1].ends_with(": warning: moved to another worker tokens=7 (request{id=5 worker=\"mac-2\"})"),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn json_lines_are_objects_with_structured_fields_and_spans() {
        let out = captured(LogFormat::Json, log_a_request);
        let lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).expect("a JSON object a line")).collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!((lines[0]["level"].as_str(), lines[0]["message"].as_str()), (Some("INFO"), Some("registered as 3")));
        let warn = &lines[1];
        assert_eq!(warn["level"], "WARN");
        assert_eq!(warn["fields"]["tokens"], 7);
        assert_eq!(warn["spans"][0]["name"], "request");
        assert_eq!((warn["spans"][0]["id"].as_u64(), warn["spans"][0]["worker"].as_str()), (Some(5), Some("mac-2")));
        assert!(warn["timestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
        assert!(warn["process"].as_str().is_some_and(|p| !p.is_empty()));
    }

    #[test]
    fn formats_parse_by_name() {
        assert_eq!("json".parse::<LogFormat>(), Ok(LogFormat::Json));
        assert_eq!(LogFormat::Human.name().parse::<LogFormat>(), Ok(LogFormat::Human));
        assert!("xml".parse::<LogFormat>().is_err());
    }
}
