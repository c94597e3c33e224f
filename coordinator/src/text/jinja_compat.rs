//! The Python behaviour Hugging Face chat templates expect from Jinja2 that
//! minijinja lacks: transformers' `tojson` (Python's `json.dumps` with
//! `ensure_ascii=False`, not minijinja's HTML-safe compact JSON),
//! `strftime_now` (Python's `datetime.now().strftime`; we use UTC), and
//! printing `None`/`True`/`False` as Python does.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind, Output, State};

/// `{{ x }}` as Jinja2 prints it: Python's spelling of none and booleans;
/// everything else as minijinja prints it.
pub fn python_formatter(out: &mut Output, state: &State, value: &Value) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.write_str("None")?,
        ValueKind::Bool => out.write_str(if value.is_true() { "True" } else { "False" })?,
        _ => minijinja::escape_formatter(out, state, value)?,
    }
    Ok(())
}

/// `{{ x | tojson(indent=2, sort_keys=true, ensure_ascii=false, separators=(",", ": ")) }}`,
/// all arguments optional, as transformers defines it.
pub fn tojson(value: Value, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let mut out = JsonWriter {
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        indent,
        // Python's defaults: ", " without indent (the newline separates items
        // with one), ": " always.
        item_sep: if indent.is_some() { ",".into() } else { ", ".into() },
        key_sep: ": ".into(),
        out: String::new(),
    };
    if let Some(seps) = separators {
        let [item, key] = <[String; 2]>::try_from(seps)
            .map_err(|_| Error::new(ErrorKind::InvalidOperation, "tojson: separators must be a pair"))?;
        (out.item_sep, out.key_sep) = (item, key);
    }
    kwargs.assert_all_used()?;
    out.value(&value, 0)?;
    Ok(out.out)
}

struct JsonWriter {
    sort_keys: bool,
    ensure_ascii: bool,
    indent: Option<usize>,
    item_sep: String,
    key_sep: String,
    out: String,
}

impl JsonWriter {
    fn value(&mut self, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => self.out.push_str("null"),
            ValueKind::Bool => self.out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number if value.is_integer() => write!(self.out, "{value}").map_err(fmt_error)?,
            ValueKind::Number => {
                let f = f64::try_from(value.clone())?;
                self.out.push_str(&python_float(f));
            }
            ValueKind::String => self.string(value.as_str().unwrap_or_default()),
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort_by_key(|k| k.to_string());
                }
                let mut items = Vec::with_capacity(keys.len());
                for key in keys {
                    let item = value.get_item(&key)?;
                    items.push((key, item));
                }
                self.container('{', '}', items.len(), depth, |w, i| {
                    let (key, item) = &items[i];
                    // Python turns non-string keys into strings.
                    w.string(key.as_str().map_or_else(|| key.to_string(), str::to_string).as_str());
                    w.out.push_str(&w.key_sep.clone());
                    w.value(item, depth + 1)
                })?;
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.container('[', ']', items.len(), depth, |w, i| w.value(&items[i], depth + 1))?;
            }
            _ => self.string(&value.to_string()),
        }
        Ok(())
    }

    fn container(
        &mut self,
        open: char,
        close: char,
        len: usize,
        depth: usize,
        mut item: impl FnMut(&mut Self, usize) -> Result<(), Error>,
    ) -> Result<(), Error> {
        self.out.push(open);
        if len == 0 {
            self.out.push(close);
            return Ok(());
        }
        for i in 0..len {
            if i > 0 {
                self.out.push_str(&self.item_sep.clone());
            }
            self.newline(depth + 1);
            item(self, i)?;
        }
        self.newline(depth);
        self.out.push(close);
        Ok(())
    }

    fn newline(&mut self, depth: usize) {
        if let Some(indent) = self.indent {
            self.out.push('\n');
            self.out.extend(std::iter::repeat_n(' ', indent * depth));
        }
    }

    /// Python's escaping: quotes, backslash, control characters; non-ASCII
    /// only with `ensure_ascii` (as UTF-16 `\uXXXX`).
    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(self.out, "\\u{unit:04x}");
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }
}

fn fmt_error(e: std::fmt::Error) -> Error {
    Error::new(ErrorKind::InvalidOperation, "tojson: formatting failed").with_source(e)
}

/// Python's `repr(float)`: `1.0`, `1e+20`, `1e-05`, `NaN`, `Infinity`.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    // Rust's shortest round-trip digits match Python's; only the exponent
    // style differs (Python: at least two digits, explicit sign). Both switch
    // to exponent form at 1e16, but Rust already below 1e-5 and Python
    // below 1e-4, so small numbers are formatted here explicitly.
    let s = if f != 0.0 && f.abs() < 1e-4 { format!("{f:e}") } else { format!("{f:?}") };
    match s.split_once('e') {
        None => s,
        Some((mantissa, exp)) => {
            let (sign, digits) = exp.strip_prefix('-').map_or(("+", exp), |d| ("-", d));
            format!("{mantissa}e{sign}{digits:0>2}")
        }
    }
}

/// `strftime_now("%d %b %Y")`: the current UTC time, Python `strftime` style.
pub fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    strftime(format, secs)
}

/// The directives templates use (C89's plus glibc's `%-d` style no-padding
/// flag and `%e`), formatted by chrono; others are copied through, as
/// glibc does.
pub fn strftime(format: &str, unix_secs: u64) -> String {
    const KNOWN: &str = "YymdejHIMSpAaBbhFTZz%";
    let Some(time) = i64::try_from(unix_secs).ok().and_then(|s| chrono::DateTime::from_timestamp(s, 0)) else {
        return format.to_string();
    };
    let mut out = String::new();
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.next_if_eq(&'-').is_some();
        let flag = if unpadded { "-" } else { "" };
        match chars.next() {
            Some(d) if KNOWN.contains(d) => out += &time.format(&format!("%{flag}{d}")).to_string(),
            Some(other) => out += &format!("%{flag}{other}"),
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", tojson);
        env.render_str(source, ctx).expect("render")
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let data = Value::from_serialize(serde_json::json!({
            "name": "get_weather", "n": 3, "x": 1.5, "big": 1e20, "tiny": 1e-5, "ok": true, "none": null,
            "list": [1, "two", []], "empty": {}, "text": "caf\u{e9} \"q\" \\ \n\t\u{1} </tag> 🦀"
        }));
        // serde_json's map (and so the input here) has its keys sorted.
        assert_eq!(
            render("{{ d | tojson }}", minijinja::context! { d => data.clone() }),
            r#"{"big": 1e+20, "empty": {}, "list": [1, "two", []], "n": 3, "name": "get_weather", "none": null, "ok": true, "text": "café \"q\" \\ \n\t\u0001 </tag> 🦀", "tiny": 1e-05, "x": 1.5}"#
        );
        assert_eq!(
            render(
                "{{ d | tojson(indent=2) }}",
                minijinja::context! { d => Value::from_serialize(serde_json::json!({"a": [1, {"b": null}], "c": []})) }
            ),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": null\n    }\n  ],\n  \"c\": []\n}"
        );
        assert_eq!(render("{{ 'é🦀' | tojson(ensure_ascii=true) }}", Value::UNDEFINED), r#""\u00e9\ud83e\udd80""#);
        assert_eq!(render("{{ [1, 2] | tojson(separators=[',', ':']) }}", Value::UNDEFINED), "[1,2]");
        assert_eq!(render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", Value::UNDEFINED), r#"{"a": 2, "b": 1}"#);
    }

    #[test]
    fn python_float_repr() {
        for (f, s) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e-7, "1.5e-07"),
            (0.0001, "0.0001"),
            (123456.0, "123456.0"),
        ] {
            assert_eq!(python_float(f), s);
        }
        assert_eq!(python_float(f64::NAN), "NaN");
    }

    #[test]
    fn strftime_formats_utc() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(strftime("%d %b %Y", t), "23 Jul 2024");
        assert_eq!(
            strftime("%A %B %-d, %Y %H:%M:%S %p %I %j %y %Z%% %Q", t),
            "Tuesday July 23, 2024 14:05:09 PM 02 205 24 UTC% %Q"
        );
        assert_eq!(strftime("%F %T %a %-m/%e", 0), "1970-01-01 00:00:00 Thu 1/ 1");
        assert_eq!(strftime("%Y-%m-%d", 951_782_400), "2000-02-29");
        assert_eq!(strftime("trailing %", 0), "trailing %");
        assert!(strftime_now("%Y").parse::<i32>().is_ok_and(|y| y >= 2024));
    }
}
