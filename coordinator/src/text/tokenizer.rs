//! A model's tokenizer as transformers' `AutoTokenizer` sees it: the
//! `tokenizers` pipeline of `tokenizer.json`, plus the special tokens, chat
//! template and length limit of `tokenizer_config.json`, and the EOS ids of
//! `generation_config.json` (falling back to `config.json`).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("reading {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not valid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path} is not a usable tokenizer: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: `{field}` is invalid: {message}")]
    Field { path: PathBuf, field: &'static str, message: String },
    #[error("encoding failed: {0}")]
    Encode(String),
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Including added tokens. Computed once: `tokenizers` builds the whole
    /// vocabulary map to answer it (milliseconds for a 150k vocabulary).
    vocab_size: usize,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
    model_max_length: Option<usize>,
    /// `<0xHH>` pieces: the ByteFallback decoder joins runs of these into
    /// one UTF-8 string, so their text is not final until the run ends.
    byte_ids: HashSet<u32>,
    /// Added tokens marked special: what `skip_special_tokens` drops.
    special_ids: HashSet<u32>,
    /// Added tokens (special or not): their pieces are literal text.
    added_ids: HashSet<u32>,
    /// The decoder is byte-level BPE's (GPT-2, Llama 3, Qwen): each byte of
    /// text is spelled as one printable character in the pieces.
    byte_level: bool,
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required) and, when present,
    /// `tokenizer_config.json`, `generation_config.json` and `config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        let bytes = std::fs::read(&path).map_err(|source| TokenizerError::Io { path: path.clone(), source })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizerError::Load { path: path.clone(), message: e.to_string() })?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json(&config_path)?.unwrap_or(Value::Null);
        let field = |field: &'static str, message: &str| TokenizerError::Field {
            path: config_path.clone(),
            field,
            message: message.to_string(),
        };
        let bos_token = token_string(config.get("bos_token")).map_err(|m| field("bos_token", m))?;
        let eos_token = token_string(config.get("eos_token")).map_err(|m| field("eos_token", m))?;
        let chat_template = chat_template(config.get("chat_template")).map_err(|m| field("chat_template", m))?;
        let model_max_length = config.get("model_max_length").and_then(max_length);

        let mut eos_token_ids = Vec::new();
        for name in ["generation_config.json", "config.json"] {
            let path = dir.join(name);
            if let Some(value) = read_json(&path)?.as_ref().and_then(|c| c.get("eos_token_id")).filter(|v| !v.is_null())
            {
                eos_token_ids = token_ids(value).map_err(|m| TokenizerError::Field {
                    path,
                    field: "eos_token_id",
                    message: m.to_string(),
                })?;
                break;
            }
        }
        if eos_token_ids.is_empty() {
            eos_token_ids.extend(eos_token.as_deref().and_then(|t| inner.token_to_id(t)));
        }

        let byte_ids = (0..=255u8).filter_map(|b| inner.token_to_id(&format!("<0x{b:02X}>"))).collect();
        let added = inner.get_added_tokens_decoder();
        let special_ids = added.iter().filter(|(_, t)| t.special).map(|(&id, _)| id).collect();
        let added_ids = added.keys().copied().collect();
        let byte_level = serde_json::to_value(inner.get_decoder()).is_ok_and(|d| is_byte_level_decoder(&d));
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            vocab_size,
            bos_token,
            eos_token,
            eos_token_ids,
            chat_template,
            model_max_length,
            byte_ids,
            special_ids,
            added_ids,
            byte_level,
        })
    }

    /// `add_special_tokens` runs the post-processor (e.g. prepends BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner.encode(text, add_special_tokens).map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids outside the vocabulary are ignored, as `tokenizers` does; the
    /// decoders of real tokenizers cannot fail, so an error decodes to "".
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        self.inner.decode(ids, skip_special_tokens).unwrap_or_default()
    }

    /// One token's piece as the vocabulary spells it (`Ġhello`, `▁time`,
    /// `<0xE2>`), as transformers' `convert_ids_to_tokens`.
    pub fn token_piece(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_default()
    }

    /// The bytes one token adds to the text: byte-level BPE's characters
    /// mapped back to their bytes, a `<0xHH>` piece as its byte, SentencePiece's
    /// `▁` as a space. A token may hold part of a UTF-8 character; OpenAI's
    /// chat logprobs give these bytes so that clients can join them.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let piece = self.token_piece(id);
        if self.added_ids.contains(&id) {
            return piece.into_bytes();
        }
        if self.byte_level
            && let Some(bytes) = piece.chars().map(byte_level_byte).collect::<Option<Vec<u8>>>()
        {
            return bytes;
        }
        let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
        if self.byte_ids.contains(&id)
            && let Some(byte) = hex.and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![byte];
        }
        piece.replace('\u{2581}', " ").into_bytes()
    }

    /// One token as text, for logprobs: its bytes, with a partial UTF-8
    /// character as U+FFFD (as vLLM).
    pub fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(&self.token_bytes(id)).into_owned()
    }

    /// Including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Every id that ends generation (a model may have several, e.g. Llama 3's
    /// `<|eot_id|>` and `<|end_of_text|>`).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The Jinja source of the default chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// `None` when unset or one of transformers' "no limit" sentinels (1e30).
    pub fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }

    pub(crate) fn is_byte_token(&self, id: u32) -> bool {
        self.byte_ids.contains(&id)
    }

    /// The id of `text` when the vocabulary has it as one special token
    /// (`[TOOL_CALLS]`, `<|channel|>`).
    pub fn special_token_id(&self, text: &str) -> Option<u32> {
        self.inner.token_to_id(text).filter(|id| self.special_ids.contains(id))
    }

    pub(crate) fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }
}

/// `Ok(None)` when the file does not exist: every file but `tokenizer.json`
/// is optional in a Hugging Face model directory.
/// Whether a `tokenizer.json` decoder (as JSON) is, or contains, ByteLevel.
fn is_byte_level_decoder(decoder: &Value) -> bool {
    decoder.get("type").and_then(Value::as_str) == Some("ByteLevel")
        || decoder.get("decoders").and_then(Value::as_array).is_some_and(|d| d.iter().any(is_byte_level_decoder))
}

/// The byte that byte-level BPE (GPT-2's `bytes_to_unicode`) spells as `c`:
/// printable Latin-1 bytes stand for themselves, and the other 68 bytes, in
/// order, were moved to U+0100 onwards.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let code = u32::from(c);
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    let index = (code - 256) as usize;
    (0u32..256).filter(|&b| !printable(b)).nth(index).map(|b| b as u8)
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(TokenizerError::Io { path: path.to_path_buf(), source }),
    };
    serde_json::from_str(&text).map(Some).map_err(|source| TokenizerError::Json { path: path.to_path_buf(), source })
}

/// `"<s>"`, or an `AddedToken` written out as `{"content": "<s>", ...}`.
fn token_string(value: Option<&Value>) -> Result<Option<String>, &'static str> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err("an object without a string `content`"),
        },
        Some(_) => Err("expected a string or an object with `content`"),
    }
}

/// A string, or a list of `{"name", "template"}` of which "default" is used.
fn chat_template(value: Option<&Value>) -> Result<Option<String>, &'static str> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let default = list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some("default"));
            match default.map(|t| t.get("template")) {
                None => Ok(None),
                Some(Some(Value::String(s))) => Ok(Some(s.clone())),
                Some(_) => Err("the \"default\" entry has no string `template`"),
            }
        }
        Some(_) => Err("expected a string or a list of {name, template}"),
    }
}

/// An int or a list of ints.
fn token_ids(value: &Value) -> Result<Vec<u32>, &'static str> {
    let one = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or("expected token ids (u32)");
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(list) => list.iter().map(one).collect(),
        v => Ok(vec![one(v)?]),
    }
}

/// transformers writes `int(1e30)` for "no limit"; anything past 2^53 is
/// treated as unset.
fn max_length(value: &Value) -> Option<usize> {
    let n = value.as_u64().or_else(|| value.as_f64().filter(|f| f.is_finite() && *f >= 0.0).map(|f| f as u64))?;
    (n < 1 << 53).then(|| usize::try_from(n).ok()).flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TEST_DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests");

    fn model(name: &str) -> Tokenizer {
        Tokenizer::from_dir(&Path::new(TEST_DATA).join("models").join(name)).expect("load tokenizer")
    }

    fn golden(name: &str) -> Value {
        let path = Path::new(TEST_DATA).join("golden").join(name);
        serde_json::from_str(&std::fs::read_to_string(path).expect("read golden")).expect("golden json")
    }

    fn ids(v: &Value) -> Vec<u32> {
        v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
    }

    #[test]
    fn stories260k_golden_encode_and_decode() {
        let tok = model("stories260K");
        let golden = golden("stories260K.json");
        let cases = golden["cases"].as_array().expect("cases");
        assert_eq!(cases.len(), 9);
        for case in cases {
            let name = case["id"].as_str().unwrap_or("?");
            let prompt = case["prompt_text"].as_str().expect("prompt_text");
            let prompt_ids = ids(&case["prompt_ids"]);
            assert_eq!(tok.encode(prompt, true).expect("encode"), prompt_ids, "{name}: prompt ids");
            let generated = ids(&case["generated_ids"]);
            assert_eq!(
                tok.decode(&generated, false),
                case["generated_text"].as_str().expect("text"),
                "{name}: generated text"
            );
            let all: Vec<u32> = prompt_ids.iter().chain(&generated).copied().collect();
            assert_eq!(tok.decode(&all, true), case["full_text"].as_str().expect("full"), "{name}: full text");
        }
    }

    #[test]
    fn every_golden_model_encodes_its_prompts() {
        for name in ["tiny-qwen3", "tiny-qwen2", "tiny-llama3", "tiny-mistral"] {
            let tok = model(name);
            for case in golden(&format!("{name}.json"))["cases"].as_array().expect("cases") {
                let prompt = case["prompt_text"].as_str().expect("prompt_text");
                assert_eq!(
                    tok.encode(prompt, true).expect("encode"),
                    ids(&case["prompt_ids"]),
                    "{name} {}",
                    case["id"]
                );
            }
        }
    }

    /// A byte-level BPE tokenizer (GPT-2's scheme, as Llama 3's and Qwen's):
    /// the 256 byte characters, a few merges, and `<|im_end|>` added.
    fn byte_level_tokenizer() -> Tokenizer {
        let alphabet: Vec<char> =
            (0..512u32).filter_map(char::from_u32).filter(|&c| byte_level_byte(c).is_some()).collect();
        assert_eq!(alphabet.len(), 256);
        let mut vocab: serde_json::Map<String, Value> =
            alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), Value::from(i))).collect();
        let merges = ["\u{120} t", "\u{120}t i", "\u{120}ti m", "\u{120}tim e", "O n", "On c", "Onc e"];
        for merge in merges {
            vocab.insert(merge.replace(' ', ""), Value::from(vocab.len()));
        }
        let end = vocab.len();
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "normalizer": null, "post_processor": null,
            "added_tokens": [{"id": end, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": merges},
        });
        let dir = scratch_dir("byte-level", &[("tokenizer.json", &tokenizer.to_string())]);
        Tokenizer::from_dir(&dir).expect("a byte-level tokenizer")
    }

    /// A text's tokens' bytes join into the text's bytes, multi-byte
    /// characters split over tokens included: byte-level BPE and
    /// SentencePiece with byte fallback (the test models) alike.
    #[test]
    fn token_bytes_join_into_the_text() {
        let text = "Once upon a time: héllo wörld, 世界 🙂 naïve\ttabs";
        let mut tokenizers: Vec<(&str, Tokenizer)> =
            ["tiny-qwen3", "tiny-llama3", "stories260K"].into_iter().map(|name| (name, model(name))).collect();
        tokenizers.push(("byte-level", byte_level_tokenizer()));
        for (name, tok) in &tokenizers {
            let ids = tok.encode(text, false).expect("encode");
            let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
            let joined = String::from_utf8(bytes).expect("whole characters once joined");
            // SentencePiece prepends a space to the text.
            assert_eq!(joined.strip_prefix(' ').filter(|_| !tok.byte_level).unwrap_or(&joined), text, "{name}");
        }
        let (_, bpe) = tokenizers.pop().expect("byte-level");
        assert!(bpe.byte_level && !tokenizers.iter().any(|(_, t)| t.byte_level));
        let time = bpe.encode(" time", false).expect("encode");
        assert_eq!((bpe.token_piece(time[0]), bpe.token_text(time[0])), ("\u{120}time".into(), " time".into()));
        let emoji = bpe.encode("🙂", false).expect("encode");
        assert_eq!(emoji.len(), 4, "one token a byte");
        assert_eq!(bpe.token_bytes(emoji[0]), [0xF0]);
        assert_eq!(bpe.token_text(emoji[0]), "\u{FFFD}", "a partial character reads as U+FFFD");
        let end = bpe.token_to_id("<|im_end|>").expect("an added token");
        assert_eq!(bpe.token_bytes(end), b"<|im_end|>");
        let llama = model("stories260K");
        let byte = llama.token_to_id("<0xE4>").expect("a byte piece");
        assert_eq!((llama.token_bytes(byte), llama.token_piece(byte)), (vec![0xE4], "<0xE4>".into()));
    }

    #[test]
    fn special_tokens_and_limits_from_configs() {
        let tok = model("tiny-qwen3");
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("</s>"));
        assert_eq!(tok.eos_token_ids(), &[2]);
        assert_eq!(tok.model_max_length(), Some(1024));
        assert!(tok.chat_template().is_some_and(|t| t.contains("add_generation_prompt")));
        assert_eq!(model("stories260K").chat_template(), None);
        assert_eq!(model("stories260K").model_max_length(), Some(512));
        // Llama 2's vocabulary has all 256 byte pieces; <s> and </s> are special.
        assert_eq!(tok.byte_ids.len(), 256);
        assert!(tok.is_special(1) && tok.is_special(2) && !tok.is_special(1404));
        assert_eq!(tok.encode("<s>user", false).expect("encode"), vec![1, 1404]);
    }

    #[test]
    fn config_value_shapes() {
        assert_eq!(token_string(Some(&json!("<s>"))), Ok(Some("<s>".into())));
        assert_eq!(token_string(Some(&json!({"content": "<|eot|>", "lstrip": false}))), Ok(Some("<|eot|>".into())));
        assert_eq!(token_string(Some(&Value::Null)), Ok(None));
        assert!(token_string(Some(&json!(3))).is_err());
        let list = json!([{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]);
        assert_eq!(chat_template(Some(&list)), Ok(Some("D".into())));
        assert_eq!(chat_template(Some(&json!([{"name": "rag", "template": "R"}]))), Ok(None));
        assert!(chat_template(Some(&json!(7))).is_err());
        assert_eq!(token_ids(&json!(2)), Ok(vec![2]));
        assert_eq!(token_ids(&json!([128001, 128009])), Ok(vec![128001, 128009]));
        assert!(token_ids(&json!(-1)).is_err());
        assert!(token_ids(&json!(["x"])).is_err());
        assert_eq!(max_length(&json!(4096)), Some(4096));
        assert_eq!(max_length(&json!(1e30)), None);
        assert_eq!(max_length(&json!(1000000000000000019884624838656u128 as f64)), None);
    }

    /// A scratch model directory with only the files a test writes.
    fn scratch_dir(tag: &str, files: &[(&str, &str)]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("tinyvllm-tok-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        for (name, text) in files {
            std::fs::write(dir.join(name), text).expect("write");
        }
        dir
    }

    #[test]
    fn errors_name_the_file() {
        let tokenizer_json =
            std::fs::read_to_string(Path::new(TEST_DATA).join("models/stories260K/tokenizer.json")).expect("read");
        let missing = scratch_dir("missing", &[]);
        let err = Tokenizer::from_dir(&missing).err().expect("missing tokenizer.json");
        assert!(matches!(err, TokenizerError::Io { .. }) && err.to_string().contains("tokenizer.json"), "{err}");

        let garbage = scratch_dir("garbage", &[("tokenizer.json", "{\"not\": \"a tokenizer\"}")]);
        let err = Tokenizer::from_dir(&garbage).err().expect("bad tokenizer.json");
        assert!(matches!(err, TokenizerError::Load { .. }) && err.to_string().contains("tokenizer.json"), "{err}");

        let bad_config =
            scratch_dir("badcfg", &[("tokenizer.json", &tokenizer_json), ("tokenizer_config.json", "{oops")]);
        let err = Tokenizer::from_dir(&bad_config).err().expect("bad config");
        assert!(
            matches!(err, TokenizerError::Json { .. }) && err.to_string().contains("tokenizer_config.json"),
            "{err}"
        );

        let bad_eos = scratch_dir(
            "badeos",
            &[("tokenizer.json", &tokenizer_json), ("generation_config.json", "{\"eos_token_id\": \"x\"}")],
        );
        let err = Tokenizer::from_dir(&bad_eos).err().expect("bad eos");
        assert!(
            err.to_string().contains("generation_config.json") && err.to_string().contains("eos_token_id"),
            "{err}"
        );

        for dir in [missing, garbage, bad_config, bad_eos] {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    #[test]
    fn eos_fallbacks() {
        let tokenizer_json =
            std::fs::read_to_string(Path::new(TEST_DATA).join("models/stories260K/tokenizer.json")).expect("read");
        // config.json when generation_config.json has none; a list is kept whole.
        let dir =
            scratch_dir("cfg", &[("tokenizer.json", &tokenizer_json), ("config.json", "{\"eos_token_id\": [2, 5]}")]);
        assert_eq!(Tokenizer::from_dir(&dir).expect("load").eos_token_ids(), &[2, 5]);
        let _ = std::fs::remove_dir_all(&dir);
        // Only the eos_token string: its id.
        let dir = scratch_dir(
            "str",
            &[
                ("tokenizer.json", &tokenizer_json),
                ("tokenizer_config.json", "{\"eos_token\": {\"content\": \"</s>\"}}"),
            ],
        );
        let tok = Tokenizer::from_dir(&dir).expect("load");
        assert_eq!((tok.eos_token(), tok.eos_token_ids(), tok.bos_token()), (Some("</s>"), &[2u32][..], None));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
